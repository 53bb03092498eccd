"""Which memory allocator for the CPU trainer? The default job cut to a few steps without
evaluations, run under each allocator in turn (interleaved rounds: this machine is shared
and noisy): the C library's malloc, tcmalloc (Debian's libtcmalloc-minimal4, where
installed) and mimalloc (the `cmeel-mimalloc` wheel of requirements.txt), with run.py's settings
(`launch.ALLOCATOR_ENV`) and with mimalloc's own (transparent huge pages).

    python benchmarks/allocators.py                      # 6 steps, 2 rounds
    python benchmarks/allocators.py --steps 4 --rounds 1 --out benchmarks/results/allocators.json
    python benchmarks/allocators.py --allocators mimalloc,mimalloc-thp --steps 12 --rounds 2
    python benchmarks/allocators.py --allocators tcmalloc-kept,tcmalloc --steps 12 --rounds 2
    python benchmarks/allocators.py --allocators mimalloc,mimalloc-purge0 --steps 12 --rounds 2
    python benchmarks/allocators.py --allocators mimalloc,mimalloc-nopurge --steps 12 --rounds 2 --engine hf
    python benchmarks/allocators.py --allocators mimalloc-kept,mimalloc,mimalloc-onednn64 --steps 30 --rounds 2

tcmalloc-kept and mimalloc-kept are tcmalloc and mimalloc with `--no-return-memory`: the trainer
keeps the free pages (mimalloc's own purge after a delay aside);
mimalloc-purge0 is mimalloc returning a page to the system as soon as it is empty
(MIMALLOC_PURGE_DELAY=0), mimalloc-nopurge never (MIMALLOC_PURGE_DELAY=-1: mi_collect
returns nothing either); mimalloc-onednnN is mimalloc with oneDNN keeping at most N primitives
(ONEDNN_PRIMITIVE_CACHE_CAPACITY=N; its default 1024): each packed length of the trainer's tokens
makes new matrix-product primitives, which the cache keeps for the whole run.

Prints per allocator: the trainer's step (time/train_s, steps after the first), wall seconds
per step, the minor page faults of the whole job (all its processes), the trainer's and the
explorer's peak RSS; then each allocator's ratio to the C library's malloc.
"""

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import launch  # noqa: E402


def one_run(lib: str | None, settings: dict, steps: int, flags: list[str]) -> dict:
    """Run the default job for `steps` steps with `lib` preloaded (None: the C library's
    malloc) and environment `settings`; its metrics and the job's minor page faults."""
    with tempfile.TemporaryDirectory() as run_dir:
        env = {
            k: v
            for k, v in os.environ.items()
            if k != "LD_PRELOAD" and not k.startswith("MIMALLOC_")
        } | settings
        if lib:
            env["LD_PRELOAD"] = lib
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        # --allocator system: run.py leaves LD_PRELOAD as this script set it
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "1",
                str(ROOT / "run.py"),
                "--mode",
                "both",
                "--sync-interval",
                "2",
                "--steps",
                str(steps),
                "--eval-size",
                "0",
                "--allocator",
                "system",
                "--run-dir",
                run_dir,
                *flags,
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
        recs = [
            json.loads(x) for x in open(Path(run_dir) / "metrics.jsonl") if '"loss/grad_norm"' in x
        ]
    return {
        "train_s": statistics.mean(r["time/train_s"] for r in recs[1:]),
        "s_per_step": (recs[-1]["time/elapsed_s"] - recs[0]["time/elapsed_s"]) / (len(recs) - 1),
        "minor_faults_m": faults / 1e6,
        "trainer_rss_gib": max(r["memory/trainer_peak_rss_gib"] for r in recs),
        "explorer_rss_gib": max(r["memory/explorer_peak_rss_gib"] for r in recs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="trainer steps per run (at least 3)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the allocators")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument(
        "--allocators",
        default="glibc,tcmalloc,mimalloc,mimalloc-thp",
        help="comma-separated: glibc, tcmalloc, mimalloc (with run.py's settings), mimalloc-thp "
        "(transparent huge pages allowed, mimalloc's own default), mimalloc-purge0 (run.py's "
        "settings, MIMALLOC_PURGE_DELAY=0), mimalloc-nopurge (MIMALLOC_PURGE_DELAY=-1), "
        "tcmalloc-kept and mimalloc-kept (--no-return-memory), "
        "mimalloc-onednnN (run.py's settings, ONEDNN_PRIMITIVE_CACHE_CAPACITY=N)",
    )
    args, flags = p.parse_known_args()
    if args.steps < 3:
        p.error("--steps must be at least 3 (the first step is not timed)")
    # name -> (allocator, its environment, run.py flags)
    variants = {
        "glibc": (None, {}, []),
        "mimalloc-thp": ("mimalloc", {"MIMALLOC_ALLOW_THP": "1"}, []),
        # freed pages returned to the system at the free that empties them, not after a delay
        # checked only at the owning thread's next allocation
        "mimalloc-purge0": (
            "mimalloc",
            {**launch.ALLOCATOR_ENV["mimalloc"], "MIMALLOC_PURGE_DELAY": "0"},
            [],
        ),
        # freed pages never returned by mimalloc itself (the trainer's returns before its peaks
        # are then no-ops too): no page faults after the first steps, the most memory
        "mimalloc-nopurge": (
            "mimalloc",
            {**launch.ALLOCATOR_ENV["mimalloc"], "MIMALLOC_PURGE_DELAY": "-1"},
            [],
        ),
        **{name: (name, launch.ALLOCATOR_ENV.get(name, {}), []) for name in launch.ALLOCATORS},
        **{
            f"{name}-kept": (name, launch.ALLOCATOR_ENV.get(name, {}), ["--no-return-memory"])
            for name in launch.ALLOCATORS
        },
    }
    allocators = {}
    for name in args.allocators.split(","):
        if capacity := re.fullmatch(r"mimalloc-onednn(\d+)", name):
            cache = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity[1]}
            variants[name] = ("mimalloc", {**launch.ALLOCATOR_ENV["mimalloc"], **cache}, [])
        if name not in variants:
            p.error(
                f"--allocators: unknown {name!r} (one of {', '.join(variants)}, mimalloc-onednnN)"
            )
        lib_name, settings, extra = variants[name]
        lib = lib_name and launch.allocator_library(lib_name)
        if lib_name and not lib:
            print(f"{name}: not installed, skipped")
        else:
            allocators[name] = lib, settings, extra
    runs: dict[str, list[dict]] = {name: [] for name in allocators}
    for r in range(args.rounds):
        for name, (lib, settings, extra) in allocators.items():
            runs[name].append(one_run(lib, settings, args.steps, [*flags, *extra]))
            print(
                f"round {r + 1} {name}: "
                + ", ".join(f"{k} {v:.3g}" for k, v in runs[name][-1].items()),
                flush=True,
            )
    mean = {
        name: {k: statistics.mean(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()
    }
    print(
        f"\n{platform.processor() or platform.machine()}, torch threads by run.py's default split, "
        f"{args.steps} steps x {args.rounds} rounds"
    )
    print(
        f"{'allocator':10s} {'train_s':>8s} {'s/step':>8s} {'faults(M)':>10s} {'trainer GiB':>12s} {'explorer GiB':>13s}"
    )
    for name, m in mean.items():
        print(
            f"{name:10s} {m['train_s']:8.2f} {m['s_per_step']:8.2f} {m['minor_faults_m']:10.2f} "
            f"{m['trainer_rss_gib']:12.2f} {m['explorer_rss_gib']:13.2f}"
        )
    base = next(iter(mean))
    for name, m in mean.items():
        if name != base:
            print(f"{name} / {base}: " + ", ".join(f"{k} {m[k] / mean[base][k]:.2f}x" for k in m))
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"steps": args.steps, "rounds": args.rounds, "runs": runs, "mean": mean}, indent=1
            )
        )


if __name__ == "__main__":
    main()
