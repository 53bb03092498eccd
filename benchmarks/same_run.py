"""Are two runs the same run? Compares the per-step rewards, losses, gradient norms,
entropies and response lengths, and the held-out accuracies, of two metrics.jsonl files
(for example the default job recorded before a change of code layout and after it).

    python benchmarks/same_run.py benchmarks/results/layout_baseline_metrics.jsonl runs/after/metrics.jsonl

Recorded baseline: the default job cut to 4 steps and 50 held-out tasks, `torchrun run.py
--mode both --sync-interval 2 --steps 4 --eval-size 50 --run-dir DIR`, on a 2-core Intel Xeon
VM (family 6 model 167, AVX-512 BF16 and AMX: bf16 autocast), torch 2.13.0+cpu. Prints one line
per step and the largest relative difference; exit code 1 when any compared number differs by
more than --rtol (default 0: identical).
"""

import argparse
import json
import sys

KEYS = ("reward/mean", "loss/policy", "loss/grad_norm", "loss/entropy", "response/len_mean")


def records(path: str) -> tuple[list[dict], list[tuple]]:
    """(the step records, the (version, accuracy) of each evaluation) of a metrics.jsonl."""
    recs = [json.loads(x) for x in open(path) if x.strip()]
    return (
        [r for r in recs if "loss/grad_norm" in r],
        [
            (r.get("eval/version"), r["eval/accuracy"])
            for r in recs
            if r.get("eval/accuracy") is not None
        ],
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument(
        "--rtol", type=float, default=0.0, help="largest relative difference accepted (default 0)"
    )
    args = p.parse_args()
    (sa, ea), (sb, eb) = records(args.before), records(args.after)
    worst = 0.0 if [r["step"] for r in sa] == [r["step"] for r in sb] and ea == eb else float("inf")
    for ra, rb in zip(sa, sb):
        cells = []
        for k in KEYS:
            x, y = ra.get(k), rb.get(k)
            if x is None or y is None:
                worst = worst if x is y else float("inf")
                continue
            worst = max(worst, abs(x - y) / max(abs(x), 1e-12))
            cells.append(f"{k} {x:.6g} / {y:.6g}")
        print(f"step {ra['step']}: " + ", ".join(cells))
    print(f"evaluations (version, accuracy): {ea} / {eb}")
    print(f"largest relative difference: {worst:.3g}")
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
