"""On-policy distillation against GRPO on the default job: held-out avg@k over seeds (docs/distill.md).

    python benchmarks/distill.py --teacher runs/default/final               # 3 arms x seeds 0, 1, 2
    python benchmarks/distill.py --teacher runs/default/final --arms opd --seeds 3
    python benchmarks/distill.py --plot-only                                # the table and plot again
    python benchmarks/distill.py --teacher T --steps 2 -- --eval-size 20    # run.py flags after --

Arms: grpo (the default job), opd (--teacher T --advantage none: the teacher's reverse KL alone) and
opd+grpo (--teacher T beside GRPO's advantage). Each run, one after the other (one keeps the cores busy):
`torchrun run.py --mode both --sync-interval 2 --config CONFIG --seed S --run-dir RUNS/ARM_sS ARM'S FLAGS`.
RESULTS/distill/ARM_sS.jsonl keeps its evaluations, a few metrics of each step and its wall time; earlier
seeds and arms there stay. RESULTS/distill.json: per arm and evaluated version the mean, std, min and max over
seeds of avg@k (greedy accuracy where no run sampled) and the trainer's elapsed seconds; the teacher's avg@k;
the wall time. PLOT: avg@k against steps and against wall-clock, the teacher's avg@k a horizontal line.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from seeds import records, spread

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("grpo", "opd", "opd+grpo")
STEP_KEYS = (
    "step",
    "version",
    "time/elapsed_s",
    "reward/mean",
    "distill/reverse_kl",
    "advantage/abs_mean",
)


def arm_flags(arm: str, teacher: str) -> list[str]:
    """run.py's flags of `arm` besides the default job's."""
    return {
        "grpo": [],
        "opd": ["--teacher", teacher, "--advantage", "none"],
        "opd+grpo": ["--teacher", teacher],
    }[arm]


def run_arm(arm: str, seed: int, args, extra: list[str]) -> list[dict]:
    """One run of `arm` with `seed`; returns the records kept of it (the module docstring). Exits with the tail
    of its log when it fails."""
    run_dir = Path(args.runs) / f"{arm}_s{seed}"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "run.py",
        "--mode",
        "both",
        "--sync-interval",
        "2",
        "--config",
        args.config,
        "--seed",
        str(seed),
        "--run-dir",
        str(run_dir),
        "--overwrite",
        *arm_flags(arm, args.teacher),
        *(["--steps", str(args.steps)] if args.steps else []),
        *extra,
    ]
    print(" ".join(cmd), flush=True)
    log, t0 = run_dir.parent / f"{arm}_s{seed}.log", time.perf_counter()
    with log.open("w") as out:
        res = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if res.returncode:
        sys.exit(f"{arm} seed {seed} failed (exit {res.returncode}):\n{log.read_text()[-2000:]}")
    recs = records(run_dir / "metrics.jsonl")
    kept = [r for r in recs if "eval/accuracy" in r]
    kept += [
        {k: v for k, v in r.items() if k in STEP_KEYS or k.startswith("teacher/")}
        for r in recs
        if "loss/policy" in r
    ]
    return kept + [
        {"run": {"arm": arm, "seed": seed, "wall_s": time.perf_counter() - t0, "command": cmd}}
    ]


def summarize(runs: dict[str, dict[int, list[dict]]]) -> dict:
    """distill.json's content from each arm's seeds' kept records."""
    evals = [
        r
        for seeds in runs.values()
        for recs in seeds.values()
        for r in recs
        if "eval/accuracy" in r
    ]
    metric = (
        "eval/avg_at_k" if evals and all("eval/avg_at_k" in r for r in evals) else "eval/accuracy"
    )
    out = {
        "metric": metric,
        "k": next((r["eval/k"] for r in evals if "eval/k" in r), None),
        "arms": {},
    }
    for arm, seeds in runs.items():
        at = {
            s: {r["eval/version"]: r[metric] for r in recs if "eval/accuracy" in r}
            for s, recs in seeds.items()
        }
        elapsed = {
            s: {r["version"]: r["time/elapsed_s"] for r in recs if "time/elapsed_s" in r} | {0: 0.0}
            for s, recs in seeds.items()
        }
        versions = sorted(set.intersection(*(set(v) for v in at.values())))
        mine = metric.replace("eval/", "teacher/")
        teacher = [r[mine] for recs in seeds.values() for r in recs if mine in r]
        out["arms"][arm] = {
            "seeds": sorted(seeds),
            "versions": versions,
            "score": [spread([at[s][v] for s in seeds]) for v in versions],
            "elapsed_s": [spread([elapsed[s][v] for s in seeds]) for v in versions],
            "wall_s": spread(
                [r["run"]["wall_s"] for recs in seeds.values() for r in recs if "run" in r]
            ),
            "teacher": statistics.fmean(teacher) if teacher else None,
        }
    return out


def table(summary: dict) -> str:
    """The summary as a markdown table: per arm the score at each evaluated version and the wall time."""
    name, teacher = score_name(summary), teacher_score(summary)
    versions = sorted({v for a in summary["arms"].values() for v in a["versions"]})
    lines = [
        f"| arm | seeds | {' | '.join(f'{name} @ {v}' for v in versions)} | wall (min) |",
        "|---|---|" + "---|" * len(versions) + "---|",
    ]
    for arm, a in summary["arms"].items():
        at = dict(zip(a["versions"], a["score"]))
        cells = [f"{at[v]['mean']:.3f} +- {at[v]['std']:.3f}" if v in at else "-" for v in versions]
        lines.append(
            f"| {arm} | {len(a['seeds'])} | {' | '.join(cells)} | {a['wall_s']['mean'] / 60:.1f} |"
        )
    if teacher is not None:
        lines.append(f"\nteacher: {name} {teacher:.3f} (its version-0 evaluation)")
    return "\n".join(lines)


def score_name(summary: dict) -> str:
    return f"avg@{summary['k']}" if summary["metric"] == "eval/avg_at_k" else "greedy accuracy"


def teacher_score(summary: dict) -> float | None:
    """The teacher's score, the mean over the runs that evaluated it; None without any."""
    scores = [a["teacher"] for a in summary["arms"].values() if a["teacher"] is not None]
    return statistics.fmean(scores) if scores else None


def plot(summary: dict, out: Path) -> Path:
    """The score against steps and against wall-clock minutes, mean +- std over seeds; the teacher's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for arm, a in summary["arms"].items():
        score = ([s["mean"] for s in a["score"]], [s["std"] for s in a["score"]])
        by_step.errorbar(
            a["versions"], *score, fmt="o-", capsize=3, label=f"{arm} ({len(a['seeds'])} seeds)"
        )
        by_time.errorbar(
            [e["mean"] / 60 for e in a["elapsed_s"]], *score, fmt="o-", capsize=3, label=arm
        )
    name, teacher = score_name(summary), teacher_score(summary)
    for ax in (by_step, by_time):
        if teacher is not None:
            ax.axhline(teacher, color="gray", linestyle=":", label=f"teacher {name}")
        ax.grid(alpha=0.3)
    by_step.set(xlabel="weight version (trainer steps)", ylabel=f"held-out {name}", ylim=(0, 1.02))
    by_time.set(xlabel="trainer wall-clock (minutes)")
    by_step.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--teacher", help="the teacher model (as run.py's --teacher); needed unless --plot-only"
    )
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--steps", type=int, default=0, help="trainer steps of each run (default: the config's)"
    )
    p.add_argument(
        "--config", default="configs/distill.toml", help="run.py's --config of every run"
    )
    p.add_argument(
        "--runs", default=str(ROOT / "runs" / "distill"), help="where the run directories go"
    )
    p.add_argument(
        "--results", default=str(ROOT / "benchmarks" / "results"), help="RESULTS (module docstring)"
    )
    p.add_argument("--plot", default=str(ROOT / "docs" / "distill.png"))
    p.add_argument(
        "--plot-only", action="store_true", help="the table and plot of the saved runs again"
    )
    args, extra = p.parse_known_args()
    extra = [f for f in extra if f != "--"]
    if not args.plot_only and not args.teacher:
        p.error("--teacher is needed to run the arms (or --plot-only)")
    saved = Path(args.results) / "distill"
    saved.mkdir(parents=True, exist_ok=True)
    for arm in [] if args.plot_only else args.arms:
        for seed in args.seeds:
            kept = run_arm(arm, seed, args, extra)
            (saved / f"{arm}_s{seed}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    runs = {
        arm: {
            int(f.stem.rpartition("_s")[2]): records(f)
            for f in sorted(saved.glob(f"{arm}_s*.jsonl"))
        }
        for arm in ARMS
    }
    summary = summarize({arm: seeds for arm, seeds in runs.items() if seeds})
    (Path(args.results) / "distill.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(f"plot: {plot(summary, Path(args.plot))}")


if __name__ == "__main__":
    main()
