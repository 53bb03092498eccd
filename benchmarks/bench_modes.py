"""Mode profiling as in the Trinity-RFT technical report (arXiv:2505.17826, Table 1): the
same job in each RFT mode with dummy learning (learning rate 0, everything else real:
rollouts, rewards, buffer, loss, backward, optimizer step, weight sync), measured one after
the other in one invocation, and the speedup of each over sync_interval=1.

    python benchmarks/bench_modes.py                        # default model, 20 steps per mode
    python benchmarks/bench_modes.py --steps 4 --model DIR  # quick check on another model

Wall time per mode = the trainer's elapsed time from the start of its first step to the
end of its last (start-up excluded). Idle fractions over that time: trainer = 1 -
(train + sync seconds) / wall; explorer = 1 - (seconds spent generating batches) / wall.
Fully async runs `--mode explore` and `--mode train` as two launches sharing a run
directory (checkpoint sync); in-flight is one-step off-policy plus weight updates between
decode steps. Results go to stdout and benchmarks/results/modes.json.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODES = {  # name: (run.py flags, separate explorer launch)
    "sync_interval=1": (["--sync-interval", "1"], False),
    "sync_interval=2": (["--sync-interval", "2"], False),
    "sync_interval=10": (["--sync-interval", "10"], False),
    "one-step off-policy": (["--sync-interval", "1", "--sync-offset", "1"], False),
    "fully async": (["--sync-interval", "1"], True),
    "in-flight": (["--sync-interval", "1", "--sync-offset", "1", "--inflight"], False),
}


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def call(cmd: list[str]) -> None:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")


def run_mode(name: str, flags: list[str], separate: bool, common: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        base = [sys.executable, "run.py", "--run-dir", d, *common, *flags]
        if separate:
            explorer = subprocess.Popen(
                base + ["--mode", "explore"],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            call(base + ["--mode", "train"])
            if explorer.wait(timeout=600) != 0:
                raise RuntimeError(f"{name}: the explorer failed")
            explore_recs = records(Path(d) / "explorer_explorer0.jsonl")
        else:
            call(base)
            explore_recs = []
        recs = records(Path(d) / "metrics.jsonl")
    steps = [r for r in recs if "loss/grad_norm" in r]
    first = (
        steps[0]["time/elapsed_s"]
        - steps[0]["time/wait_s"]
        - steps[0]["time/train_s"]
        - steps[0]["time/sync_s"]
    )
    wall = steps[-1]["time/elapsed_s"] - first
    explore_s = sum(r.get("time/explore_s", 0.0) for r in explore_recs or steps)
    busy_trainer = sum(r["time/train_s"] + r["time/sync_s"] for r in steps)
    return {
        "mode": name,
        "steps": len(steps),
        "wall_s": wall,
        "s_per_step": wall / len(steps),
        "trainer_idle": 1 - busy_trainer / wall,
        "explorer_idle": max(0.0, 1 - explore_s / wall),
        "max_staleness": max(r.get("staleness/max", 0) for r in steps),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default=None)
    p.add_argument("--engine", default="hf")
    p.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES)
    )
    args, extra = p.parse_known_args()
    common = (
        [
            "--steps",
            str(args.steps),
            "--lr",
            "0",
            "--eval-size",
            "0",
            "--engine",
            args.engine,
            "--batch-size",
            "4",
            "--group-size",
            "4",
            "--explorer-threads",
            "1",
            "--trainer-threads",
            "1",
            "--checkpoint-interval",
            "0",
        ]
        + (["--model", args.model] if args.model else [])
        + extra
    )
    rows = []
    for name in args.modes.split(","):
        flags, separate = MODES[name]
        rows.append(run_mode(name, flags, separate, common))
        print(f"done: {name} ({rows[-1]['s_per_step']:.1f} s/step)", file=sys.stderr, flush=True)
    base = rows[0]["wall_s"] if rows[0]["mode"] == "sync_interval=1" else None
    print(
        f"{args.steps} steps per mode, dummy learning (lr 0), batch 4 tasks x 4 rollouts, engine {args.engine}, "
        "1 thread each for explorer and trainer"
    )
    print(
        f"{'mode':<22}{'s/step':>8}{'speedup':>9}{'trainer idle':>14}{'explorer idle':>15}{'max staleness':>15}"
    )
    for r in rows:
        r["speedup"] = base / r["wall_s"] if base else float("nan")
        print(
            f"{r['mode']:<22}{r['s_per_step']:>8.2f}{r['speedup']:>8.2f}x{r['trainer_idle']:>14.2f}"
            f"{r['explorer_idle']:>15.2f}{r['max_staleness']:>15}"
        )
    out = ROOT / "benchmarks" / "results" / "modes.json"
    out.write_text(json.dumps({"args": vars(args), "extra": extra, "rows": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
