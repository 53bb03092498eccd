"""The mismatch lab's figures from runs of benchmarks/seeds.py (docs/mismatch.md): the
mismatch attribution's parts over a run's steps (--mismatch-every), and each run's importance
ratio and rollout-correction metrics beside its final held-out avg@k.

    python benchmarks/seeds.py mismatch_bf16 --seeds 0 -- --mismatch-every 5
    python benchmarks/seeds.py mismatch_fp32 --seeds 0 -- --mismatch-every 5 --dtype float32
    python benchmarks/mismatch.py parts mismatch_bf16 mismatch_fp32 --plot mismatch_parts
    python benchmarks/mismatch.py runs one_direction corr_none corr_tis corr_mis corr_icepop

`parts` prints, per run, each part's mean |delta log-prob| and k3 KL over the attributed
steps of all its seeds (and at the first and the last step, the mean over seeds), its share of
the total's |delta|, and draws benchmarks/results/seeds/PLOT.png (each part's |delta| against
the step, the mean over seeds). `runs` prints, per run, the step means of the trained
experiences' staleness (versions), the ratio pi_theta / pi_behaviour, |log-ratio|, and of the
correction's weight, capped and masked fractions, with the final and best avg@k over its seeds.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "seeds"
PARTS = ("precision", "layout", "truncation", "staleness", "total")


def steps(name: str) -> list[dict]:
    """The step records of every seed of run `name` (seeds.py's NAME_sS.jsonl)."""
    files = sorted(RESULTS.glob(f"{name}_s*.jsonl"))
    if not files:
        sys.exit(f"no results for {name}: run benchmarks/seeds.py {name} first")
    out = []
    for f in files:
        for line in f.read_text().splitlines():
            record = json.loads(line)
            if "loss/grad_norm" in record:
                out.append(record)
    return out


def mean(records: list[dict], key: str) -> float | None:
    """The mean of `key` over the records that have it, or None."""
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else None


def by_step(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, mean of `key` over the seeds' records of that step), in step order."""
    steps_seen = sorted({r["step"] for r in records if key in r})
    return [(s, mean([r for r in records if r["step"] == s], key)) for s in steps_seen]


def parts_table(names: list[str]) -> str:
    """The markdown table of each run's attributed parts."""
    lines = [
        "| run | part | mean abs | mean k3 | share of total abs | first step abs | last step abs |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        attributed = [r for r in steps(name) if "mismatch/total/abs" in r]
        if not attributed:
            sys.exit(f"{name} has no mismatch/* metrics: run it with --mismatch-every")
        total = mean(attributed, "mismatch/total/abs")
        for part in PARTS:
            key = f"mismatch/{part}/abs"
            share = mean(attributed, key) / total if total else 0.0
            curve = by_step(attributed, key)
            lines.append(
                f"| {name} | {part} | {mean(attributed, key):.2e} | "
                f"{mean(attributed, f'mismatch/{part}/k3'):.2e} | {share:.2f} | "
                f"{curve[0][1]:.2e} | {curve[-1][1]:.2e} |"
            )
    return "\n".join(lines)


def plot_parts(names: list[str], out: str) -> Path:
    """PLOT.png: each run's parts' mean |delta log-prob| against the step (log scale; a part
    exactly 0 at a step is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        attributed = [r for r in steps(name) if "mismatch/total/abs" in r]
        for part in PARTS:
            curve = by_step(attributed, f"mismatch/{part}/abs")
            # a part that is exactly 0 (its cause absent) has no point on a log scale
            values = [value or float("nan") for _, value in curve]
            ax.plot([step for step, _ in curve], values, "o-", label=part)
        ax.set(xlabel="step", ylabel="mean |delta log-prob| (nats)", yscale="log", title=name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path = RESULTS / f"{out}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def final_avg(name: str) -> str:
    """The final and best mean avg@k of run `name` over its seeds (seeds.py's NAME.json)."""
    summary = json.loads((RESULTS / f"{name}.json").read_text())
    curve = summary["curve"]
    best = max(curve, key=lambda p: p["avg_at_k"]["mean"])
    last = curve[-1]["avg_at_k"]
    return (
        f"{last['mean']:.3f} +- {last['std']:.3f} ({len(summary['seeds'])} seeds) | "
        f"{best['avg_at_k']['mean']:.3f} (v{best['version']})"
    )


def runs_table(names: list[str]) -> str:
    """The markdown table of each run's ratio and correction metrics and final avg@k."""
    keys = (
        "staleness/mean",
        "loss/ratio_mean",
        "loss/logprob_abs_diff",
        "correction/weight",
        "correction/capped",
        "correction/masked",
    )
    lines = [
        "| run | " + " | ".join(keys) + " | final avg@k | best avg@k |",
        "|---|" + "---|" * (len(keys) + 2),
    ]
    for name in names:
        records = steps(name)
        cells = []
        for key in keys:
            value = mean(records, key)
            cells.append("-" if value is None else f"{value:.4f}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {final_avg(name)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", choices=("parts", "runs"))
    parser.add_argument("names", nargs="+", help="run names of benchmarks/seeds.py")
    parser.add_argument("--plot", default="", help="parts: also draw RESULTS/PLOT.png")
    args = parser.parse_args()
    if args.table == "parts":
        print(parts_table(args.names))
        if args.plot:
            print(f"plot: {plot_parts(args.names, args.plot)}")
    else:
        print(runs_table(args.names))


if __name__ == "__main__":
    main()
