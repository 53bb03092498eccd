"""The evaluations' share of the default job's wall time: the default job run three times in a row,
with an empty evaluation cache (a first run), again (a re-run: the base model's evaluation is
cached) and without evaluations (--eval-size 0). A share is (wall with evaluations - wall
without) / wall with evaluations: the time a user waits for the held-out numbers.

    python benchmarks/eval_share.py --out benchmarks/results/eval_share.json
    python benchmarks/eval_share.py --steps 6 --eval-interval 2     # a shorter check

Every run uses a fresh NANORFT_CACHE that shares the converted models of yours but starts
with no cached evaluation. Prints per run: wall seconds, the evaluations' own seconds
(eval/seconds summed) and the final held-out greedy accuracy and avg@k.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from ab_commits import cache_without_evals  # noqa: E402

from perf import cpu_model  # noqa: E402


def one_run(flags: list[str], cache: Path) -> dict:
    """The default job with `flags` and NANORFT_CACHE=`cache`: wall seconds and its evaluations."""
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
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
                "--run-dir",
                run_dir,
                *flags,
            ],
            env={**os.environ, "NANORFT_CACHE": str(cache)},
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - t0
        evals = [
            r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl")) if "eval/version" in r
        ]
    last = evals[-1] if evals else {}
    return {
        "wall_s": wall,
        "eval_s": sum(r["eval/seconds"] for r in evals),
        "evaluations": len(evals),
        "final_accuracy": last.get("eval/accuracy"),
        "final_avg_at_k": last.get("eval/avg_at_k"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    args, flags = p.parse_known_args()
    with tempfile.TemporaryDirectory() as where:
        cache = cache_without_evals(Path(where) / "cache")
        runs = {
            "first run": one_run(flags, cache),
            "re-run": one_run(flags, cache),
            "no evaluations": one_run([*flags, "--eval-size", "0"], cache),
        }
    cpu = f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"
    print(f"{cpu}, flags {' '.join(flags) or 'none'}")
    base = runs["no evaluations"]["wall_s"]
    for name, r in runs.items():
        r["share"] = (r["wall_s"] - base) / r["wall_s"]
        print(
            f"{name:15s} wall {r['wall_s']:6.1f} s  evaluations {r['eval_s']:5.1f} s ({r['evaluations']})  "
            f"share {r['share']:6.1%}  final greedy {r['final_accuracy']}  avg@k {r['final_avg_at_k']}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"flags": flags, "cpu": cpu, "runs": runs}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
