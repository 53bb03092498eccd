#!/bin/bash
# The side-by-side runs behind the README's AVX-512 comparison, one after the other on one machine:
#   OLD=checkout-of-a067a71 NEW=checkout-of-this-version NOLEND=this-version-with-share=False-in-loop.start_explorer \
#   OUT=dir bash run.sh
# Each arm: the default job cut to 10 steps without evaluations; /usr/bin/time's wall seconds and CPU
# at the end of OUT/ARM.err, the metrics in OUT/ARM/metrics.jsonl.
set -u
arm() { name=$1; dir=$2; shift 2; rm -rf "$OUT/$name"; (cd "$dir" && /usr/bin/time -f "%e s %P" torchrun run.py \
    --mode both --sync-interval 2 --steps 10 --eval-size 0 --run-dir "$OUT/$name" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"); }
arm old "$OLD"
arm new "$NEW"
arm nolend "$NOLEND"
arm noac "$NEW" --no-activation-checkpointing
