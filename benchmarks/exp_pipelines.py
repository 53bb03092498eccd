"""Data-pipeline experiments with the default model on this CPU (README "Data pipelines").

    python benchmarks/exp_pipelines.py --part curriculum   # easy -> hard vs shuffled, seeds 0 and 1
    python benchmarks/exp_pipelines.py --part diversity    # diversity reward vs none
    python benchmarks/exp_pipelines.py --part curriculum --plot-only

curriculum: basic_arithmetic with 2-3 terms of 1-3 digits (+/-), 160 training tasks (the
20 steps x 8 tasks of the run, so the order spans the run once), every task scored by
metadata_difficulty (num_digits + num_terms); one arm takes them easy -> hard (selector
easy2hard), the other in a seeded shuffle (selector shuffle). Held-out accuracy (100 tasks
of the same mix, greedy) against wall-clock seconds since the trainer's first step (an
evaluation of version v is placed at the end of the step that produced v).

diversity: the default job for 20 steps, with diversity_reward (weight 0.5 -> 0.3 over the
run, embeddings from the policy's initial weights) against the same operator at weight 0
(the control logs the same similarity metric but adds nothing). Token entropy of the
trained responses (loss/entropy), the group similarity and held-out accuracy over steps.

Runs go one after the other (the machine's 2 cores are shared by explorer and trainer);
metrics are copied to benchmarks/results/<part>_<arm>_s<seed>.jsonl, the plot to
benchmarks/results/<part>.png, a summary to benchmarks/results/<part>.json.
"""

import argparse
import json
import shutil
from pathlib import Path

from seeds import records, run_job

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COMMON = ["--engine", "hf", "--steps", "20", "--eval-interval", "4", "--log", "none"]
ARITHMETIC = {
    "min_terms": 2,
    "max_terms": 3,
    "min_digits": 1,
    "max_digits": 3,
    "operators": ["+", "-"],
    "allow_parentheses": False,
}
DIFFICULTY = [{"op": "metadata_difficulty", "keys": ["num_digits", "num_terms"]}]
DIVERSITY = {"op": "diversity_reward", "weight": 0.5, "final_weight": 0.3, "decay_steps": 20}
PARTS = {
    "curriculum": {
        "arms": {"easy2hard": ["--selector", "easy2hard"], "shuffled": ["--selector", "shuffle"]},
        "seeds": [0, 1],
        "flags": [
            "--task-kwargs",
            json.dumps(ARITHMETIC),
            "--train-size",
            "160",
            "--eval-size",
            "100",
            "--task-pipeline",
            json.dumps(DIFFICULTY),
        ],
    },
    "diversity": {
        "arms": {
            "diversity": ["--experience-pipeline", json.dumps([DIVERSITY])],
            "none": [
                "--experience-pipeline",
                json.dumps([{**DIVERSITY, "weight": 0.0, "final_weight": 0.0}]),
            ],
        },
        "seeds": [0],
        "flags": ["--eval-size", "100"],
    },
}


def run_arm(part: str, arm: str, seed: int, flags: list[str], model: str) -> Path:
    run_dir = ROOT / "runs" / f"exp_{part}_{arm}_s{seed}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_job(
        run_dir,
        [*COMMON, *flags, *(["--model", model] if model else [])],
        seed,
        run_dir.parent / f"{run_dir.name}.log",
    )
    out = RESULTS / f"{part}_{arm}_s{seed}.jsonl"
    shutil.copy(run_dir / "metrics.jsonl", out)
    return out


def curves(path: Path) -> dict:
    """Per run: eval accuracy by version with the wall-clock second of each, and per step
    the entropy, reward and similarity."""
    recs = records(path)
    steps = {r["step"]: r for r in recs if "loss/policy" in r}
    evals = sorted((r["eval/version"], r["eval/accuracy"]) for r in recs if "eval/accuracy" in r)
    clock = {0: 0.0, **{s + 1: r["time/elapsed_s"] for s, r in steps.items()}}
    return {
        "versions": [v for v, _ in evals],
        "accuracy": [a for _, a in evals],
        "seconds": [clock.get(v, float("nan")) for v, _ in evals],
        "steps": sorted(steps),
        "entropy": [steps[s]["loss/entropy"] for s in sorted(steps)],
        "reward_raw": [
            steps[s].get("pipeline/reward_raw_mean", steps[s]["reward/mean"]) for s in sorted(steps)
        ],
        "similarity": [
            steps[s].get("pipeline/diversity_reward/similarity_mean") for s in sorted(steps)
        ],
        "wall_s": max(r["time/elapsed_s"] for r in steps.values()),
    }


def plot(part: str, runs: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "easy2hard": "tab:blue",
        "shuffled": "tab:orange",
        "diversity": "tab:green",
        "none": "tab:gray",
    }
    if part == "curriculum":
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for (arm, seed), c in runs.items():
            style = "-" if seed == 0 else "--"
            axes[0].plot(
                c["seconds"],
                c["accuracy"],
                style,
                marker="o",
                color=colors[arm],
                label=f"{arm} seed {seed}",
            )
            axes[1].plot(
                c["steps"], c["reward_raw"], style, color=colors[arm], label=f"{arm} seed {seed}"
            )
        axes[0].set(
            xlabel="wall-clock seconds (trainer)",
            ylabel="held-out accuracy (100 tasks, greedy)",
            title="easy -> hard vs shuffled",
        )
        axes[1].set(
            xlabel="step",
            ylabel="train reward (mean of the batch)",
            title="train reward (easy2hard: easy first)",
        )
    else:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for (arm, seed), c in runs.items():
            axes[0].plot(c["steps"], c["entropy"], color=colors[arm], label=arm)
            axes[1].plot(c["steps"], c["similarity"], color=colors[arm], label=arm)
            axes[2].plot(c["versions"], c["accuracy"], marker="o", color=colors[arm], label=arm)
        axes[0].set(
            xlabel="step", ylabel="token entropy (nats)", title="entropy of the trained responses"
        )
        axes[1].set(
            xlabel="step",
            ylabel="cosine similarity to group mean",
            title="similarity within a group",
        )
        axes[2].set(
            xlabel="version", ylabel="held-out accuracy (100 tasks, greedy)", title="accuracy"
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = RESULTS / f"{part}.png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    p.add_argument("--model", default="", help="model (default: the default model)")
    p.add_argument("--plot-only", action="store_true", help="plot the saved metrics again")
    p.add_argument(
        "--arms",
        default="",
        help="comma-separated arms to run again (the others are read from results)",
    )
    args = p.parse_args()
    spec, runs = PARTS[args.part], {}
    again = set(args.arms.split(",")) if args.arms else set(spec["arms"])
    for seed in spec["seeds"]:
        for arm, flags in spec["arms"].items():
            path = RESULTS / f"{args.part}_{arm}_s{seed}.jsonl"
            if not args.plot_only and arm in again:
                path = run_arm(args.part, arm, seed, spec["flags"] + flags, args.model)
            runs[arm, seed] = curves(path)
    summary = {
        f"{arm} seed {seed}": {
            "accuracy_by_version": dict(zip(c["versions"], c["accuracy"])),
            "wall_s": round(c["wall_s"], 1),
            "entropy_first_last": [c["entropy"][0], c["entropy"][-1]],
        }
        for (arm, seed), c in runs.items()
    }
    (RESULTS / f"{args.part}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"plot: {plot(args.part, runs)}")


if __name__ == "__main__":
    main()
