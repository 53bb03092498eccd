"""Does a change of code move the default job's time per step? The same job at two commits,
run in turn (A, B, A, B, ...: the machine's load falls on both alike), each round in a fresh
run directory, the base model's evaluation cached for both (--base-eval: computed by each run, as
in a first run, which also compiles the trainer's kernels afresh).

    python benchmarks/ab_commits.py 70e27ae HEAD                 # 12 steps, two rounds
    python benchmarks/ab_commits.py 70e27ae HEAD --steps 12 --rounds 2 -- --seed 1
    python benchmarks/ab_commits.py HEAD HEAD --b-flags "--old-logprobs recompute"  # a setting
    python benchmarks/ab_commits.py 70e27ae HEAD --base-eval      # each run evaluates the base model

Each commit is checked out once into a git worktree beside the repository's; each run is
`python run.py --mode both --sync-interval 2 --steps N --run-dir DIR FLAGS` (the default job,
cut to N steps). Per run it reads metrics.jsonl: the median wall seconds per step (the
differences of time/elapsed_s, the first step left out: it holds the start), the medians of
time/train_s and time/explore_s, the sum of time/sync_s and the trainer's peak RSS. --b-flags
adds run.py flags to B's runs only: the cost of a setting at one commit. Prints one row per run,
then per figure the ratio B / A of the medians over rounds; --json writes them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import cache_dir  # noqa: E402

FIGURES = (
    "s_per_step",
    "train_s",
    "explore_s",
    "sync_s",
    "eval_s",
    "trainer_peak_gib",
    "explorer_peak_gib",
)


def worktree(rev: str, where: Path) -> Path:
    """A checkout of `rev` at `where` (git worktree, detached)."""
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(where), rev],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return where


def figures(metrics: Path) -> dict[str, float]:
    """The medians of one run's steps: wall seconds per step, train and explore seconds; the
    seconds the trainer spent publishing and the explorer evaluating, in all; the trainer's and
    the explorer's peak RSS over the run (GiB)."""
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    steps = [r for r in records if "loss/grad_norm" in r]
    elapsed = [r["time/elapsed_s"] for r in steps]
    return {
        "s_per_step": statistics.median(b - a for a, b in zip(elapsed, elapsed[1:])),
        "train_s": statistics.median(r["time/train_s"] for r in steps[1:]),
        "explore_s": statistics.median(
            r["time/explore_s"] for r in steps[1:] if "time/explore_s" in r
        ),
        "sync_s": sum(r.get("time/sync_s", 0.0) for r in steps),
        "eval_s": sum(r["eval/seconds"] for r in records if "eval/seconds" in r),
        "trainer_peak_gib": max(r["memory/trainer_peak_rss_gib"] for r in steps),
        "explorer_peak_gib": max(r.get("memory/explorer_peak_rss_gib", 0.0) for r in steps),
    }


def cache_without_evals(where: Path) -> Path:
    """A NANORFT_CACHE at `where` sharing yours (the converted models, the measured peak) except
    its cached evaluations and compiled kernels (inductor's): what a first run has."""
    where.mkdir()
    for entry in cache_dir().iterdir() if cache_dir().is_dir() else []:
        if entry.name not in ("evals", "inductor"):
            (where / entry.name).symlink_to(entry)
    return where


def run_once(
    checkout: Path, run_dir: Path, steps: int, flags: list[str], cache: Path | None = None
) -> dict:
    """One run of the cut default job in `checkout` (`cache`: its NANORFT_CACHE); its figures and
    wall time."""
    cmd = [sys.executable, "run.py", "--mode", "both", "--sync-interval", "2"]
    cmd += ["--steps", str(steps), "--run-dir", str(run_dir), "--no-plot", *flags]
    env = {**os.environ, **({"NANORFT_CACHE": str(cache)} if cache else {})}
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: run.py failed:\n{out.stderr[-3000:]}")
    return {**figures(run_dir / "metrics.jsonl"), "wall_s": time.perf_counter() - t0}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of `argv`; run.py's flags for both runs after "--" in `args.flags` (argparse
    would match them against its own options)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="the commit before (A)")
    p.add_argument("b", help="the commit after (B)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write the rows and ratios to this file")
    p.add_argument("--b-flags", default="", help="run.py flags of B's runs only (one string)")
    p.add_argument(
        "--base-eval",
        action="store_true",
        help="each run evaluates the base model and compiles its kernels (empty caches of both: a "
        "first run's waits)",
    )
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.flags = argv[cut + 1 :]
    return args


def main() -> int:
    args = parse_args(sys.argv[1:])
    # the commits themselves, not names that move (HEAD, a branch)
    for name in ("a", "b"):
        rev = ["git", "rev-parse", "--short", getattr(args, name)]
        sha = subprocess.run(rev, cwd=ROOT, check=True, capture_output=True, text=True)
        setattr(args, name, sha.stdout.strip())
    work = Path(tempfile.mkdtemp(prefix="ab_commits_"))
    checkouts = {name: worktree(rev, work / name) for name, rev in (("A", args.a), ("B", args.b))}
    rows = []
    try:
        # the model's conversion and the base model's evaluation, once, then read from the
        # cache by every run (--base-eval: the conversion only)
        run_once(checkouts["A"], work / "warm-up", 2, args.flags)
        for r in range(args.rounds):
            for name, checkout in checkouts.items():
                flags = args.flags + (args.b_flags.split() if name == "B" else [])
                cache = cache_without_evals(work / f"cache-{name}{r}") if args.base_eval else None
                row = run_once(checkout, work / f"{name}{r}", args.steps, flags, cache)
                row = {"commit": name, "round": r, **row}
                rows.append(row)
                shown = "  ".join(f"{k} {row[k]:.2f}" for k in (*FIGURES, "wall_s"))
                print(f"round {r} {name} ({getattr(args, name.lower())}): {shown}", flush=True)
    finally:
        for checkout in checkouts.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT)
    ratios = {}
    for k in (*FIGURES, "wall_s"):
        a = statistics.median(row[k] for row in rows if row["commit"] == "A")
        b = statistics.median(row[k] for row in rows if row["commit"] == "B")
        ratios[k] = b / a
        print(f"{k}: A {a:.3f}, B {b:.3f}, B / A {b / a:.3f}")
    if args.json:
        record = {"a": args.a, "b": args.b, "steps": args.steps, "flags": args.flags}
        record["b_flags"] = args.b_flags
        record["base_eval"] = args.base_eval
        Path(args.json).write_text(json.dumps({**record, "rows": rows, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
