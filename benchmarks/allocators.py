"""Which memory allocator for the CPU trainer? The default job cut to a few steps without
evaluations, run under each allocator in turn (interleaved rounds: this machine is shared
and noisy): the C library's malloc, tcmalloc (Debian's libtcmalloc-minimal4, where
installed) and mimalloc (the `cmeel-mimalloc` wheel of requirements.txt).

    python benchmarks/allocators.py                      # 6 steps, 2 rounds
    python benchmarks/allocators.py --steps 4 --rounds 1 --out benchmarks/results/allocators.json

Prints per allocator: the trainer's step (time/train_s, steps after the first), wall seconds
per step, the minor page faults of the whole job (all its processes), the trainer's and the
explorer's peak RSS; then each allocator's ratio to the C library's malloc.
"""
import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import launch  # noqa: E402


def one_run(lib: str | None, steps: int, flags: list[str]) -> dict:
    """Run the default job for `steps` steps with `lib` preloaded (None: the C library's
    malloc); its metrics and the job's minor page faults."""
    with tempfile.TemporaryDirectory() as run_dir:
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        if lib:
            env["LD_PRELOAD"] = lib
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        # --allocator system: run.py leaves LD_PRELOAD as this script set it
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(ROOT / "run.py"),
                        "--mode", "both", "--sync-interval", "2", "--steps", str(steps), "--eval-size", "0",
                        "--allocator", "system", "--run-dir", run_dir, *flags],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
        recs = [json.loads(x) for x in open(Path(run_dir) / "metrics.jsonl") if '"loss/grad_norm"' in x]
    return {"train_s": statistics.mean(r["time/train_s"] for r in recs[1:]),
            "s_per_step": (recs[-1]["time/elapsed_s"] - recs[0]["time/elapsed_s"]) / (len(recs) - 1),
            "minor_faults_m": faults / 1e6,
            "trainer_rss_gib": max(r["memory/trainer_peak_rss_gib"] for r in recs),
            "explorer_rss_gib": max(r["memory/explorer_peak_rss_gib"] for r in recs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="trainer steps per run (at least 3)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the allocators")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    args, flags = p.parse_known_args()
    if args.steps < 3:
        p.error("--steps must be at least 3 (the first step is not timed)")
    allocators = {"glibc": None}
    for name in ("tcmalloc", "mimalloc"):
        lib = launch.allocator_library(name)
        if lib:
            allocators[name] = lib
        else:
            print(f"{name}: not installed, skipped")
    runs: dict[str, list[dict]] = {name: [] for name in allocators}
    for r in range(args.rounds):
        for name, lib in allocators.items():
            runs[name].append(one_run(lib, args.steps, flags))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in runs[name][-1].items()), flush=True)
    mean = {name: {k: statistics.mean(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"\n{platform.processor() or platform.machine()}, torch threads by run.py's default split, "
          f"{args.steps} steps x {args.rounds} rounds")
    print(f"{'allocator':10s} {'train_s':>8s} {'s/step':>8s} {'faults(M)':>10s} {'trainer GiB':>12s} {'explorer GiB':>13s}")
    for name, m in mean.items():
        print(f"{name:10s} {m['train_s']:8.2f} {m['s_per_step']:8.2f} {m['minor_faults_m']:10.2f} "
              f"{m['trainer_rss_gib']:12.2f} {m['explorer_rss_gib']:13.2f}")
    for name, m in mean.items():
        if name != "glibc":
            print(f"{name} / glibc: " + ", ".join(f"{k} {m[k] / mean['glibc'][k]:.2f}x" for k in m))
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "rounds": args.rounds, "runs": runs, "mean": mean},
                                             indent=1))


if __name__ == "__main__":
    main()
