"""One configuration over several seeds: the mean and spread of its learning curve; and a
sweep, several configurations side by side.

    python benchmarks/seeds.py default --seeds 0 1 2                  # the default job, 3 seeds
    python benchmarks/seeds.py lr1e-5 --seeds 0 1 2 -- --lr 1e-5      # run.py flags after --
    python benchmarks/seeds.py default --seeds 3 4                    # two more seeds, same flags
    python benchmarks/seeds.py default --plot-only                    # summary and plot again
    python benchmarks/seeds.py --compare default lr1e-5 --out sweep   # a sweep: table and plot
    python benchmarks/seeds.py async4 --fully-async -- --max-staleness 4   # explore + train launches

Each seed runs `python run.py FLAGS --seed S --run-dir runs/seeds/NAME_sS` (the default
mode, both: one trainer rank and an explorer), one after the other: one run already keeps
the machine's cores busy; seeds saved earlier under NAME with the same flags are kept and the
new ones added. The run directory's name carries the seed, so tracker runs
(TensorBoard, W&B, MLflow: `--log`) name it too. Kept per seed in
benchmarks/results/seeds/NAME_sS.jsonl: the evaluation records and a few metrics of each
step (reward, entropy, response length, grad norm, elapsed seconds, the trainer's peak RSS).
NAME.json: the flags, the wall time of each seed, and per evaluated version the mean, the sample
standard deviation, min and max over seeds of greedy accuracy and avg@k, with the mean of
the seeds' own standard errors. NAME.png: avg@k and greedy accuracy, mean over seeds with
error bars of +- one standard deviation across seeds, each seed a thin line, and the base
model's pass@k (version 0, mean over seeds). `--compare` prints one row per name (final
and best avg@k, greedy, wall time) and draws their mean avg@k curves in one plot
(benchmarks/results/seeds/OUT.png, OUT.md).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "seeds"
STEP_KEYS = (
    "step",
    "reward/mean",
    "loss/entropy",
    "response/len_mean",
    "loss/grad_norm",
    "loss/ratio_mean",
    "loss/logprob_abs_diff",
    "loss/kl_behaviour",
    "time/elapsed_s",
    "time/train_s",
    "memory/trainer_peak_rss_gib",
)
# every metric under these prefixes too: the mismatch lab's parts and the rollout correction's,
# and how stale the trained experiences were
STEP_PREFIXES = ("mismatch/", "correction/", "old_logprobs/", "staleness/", "inflight/")


def records(path: Path) -> list[dict]:
    """The JSON records of a .jsonl file."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def failed(what: str, code: int, log: Path) -> None:
    """Exit with one line naming `what` and its exit `code`, then the tail of its `log`."""
    sys.exit(f"{what} failed (exit {code}):\n{log.read_text()[-2000:]}")


def run_job(run_dir: Path, flags: list[str], seed: int, log: Path, fully_async: bool) -> float:
    """Run `python run.py FLAGS --seed SEED --run-dir RUN_DIR --overwrite` in the
    repository, its output to `log`; fully_async: an explorer (`--mode explore`, its output to
    LOG.explore.log) and a trainer (`--mode train`) in a fresh RUN_DIR instead, at once. Returns
    the wall time (seconds). Exits with the log's tail when the run fails."""
    command = [sys.executable, "run.py", *flags, "--seed", str(seed), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    if not fully_async:
        print(" ".join(command), flush=True)
        with log.open("w") as out:
            res = subprocess.run(
                [*command, "--overwrite"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
        if res.returncode:
            failed(run_dir.name, res.returncode, log)
        return time.perf_counter() - t0
    # the launches share the run directory, so --overwrite is theirs to refuse: start it empty
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    explorer_log = log.with_suffix(".explore.log")
    print(" ".join(command), "--mode explore / --mode train", flush=True)
    with explorer_log.open("w") as out:
        explorer = subprocess.Popen(
            [*command, "--mode", "explore"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    with log.open("w") as out:
        res = subprocess.run(
            [*command, "--mode", "train"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    if res.returncode:
        explorer.kill()
        explorer.wait()
        failed(run_dir.name, res.returncode, log)
    try:  # the explorer stops by itself once the trainer has marked the run done
        code = explorer.wait(timeout=600)
    except subprocess.TimeoutExpired:
        explorer.kill()
        code = explorer.wait()
    if code:
        failed(f"{run_dir.name}'s explorer", code, explorer_log)
    return time.perf_counter() - t0


def keep(recs: list[dict]) -> list[dict]:
    """The records a curve needs: evaluations whole, of each step only STEP_KEYS and STEP_PREFIXES."""
    out = [r for r in recs if "eval/accuracy" in r]
    out += [
        {k: v for k, v in r.items() if k in STEP_KEYS or k.startswith(STEP_PREFIXES)}
        for r in recs
        if "loss/grad_norm" in r
    ]
    return out


def spread(xs: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max of `xs`."""
    return {
        "mean": statistics.fmean(xs),
        "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
    }


def summarize(
    name: str, seeds: dict[int, list[dict]], flags: list[str], wall: dict[int, float]
) -> dict:
    """NAME.json's content from each seed's kept records (see the module docstring)."""
    evals = {
        s: {r["eval/version"]: r for r in recs if "eval/accuracy" in r} for s, recs in seeds.items()
    }
    versions = sorted(set.intersection(*(set(e) for e in evals.values())))
    curve = []
    for v in versions:
        rows = [e[v] for e in evals.values()]
        point = {"version": v, "greedy": spread([r["eval/accuracy"] for r in rows])}
        if all("eval/avg_at_k" in r for r in rows):
            point["avg_at_k"] = spread([r["eval/avg_at_k"] for r in rows])
            point["avg_at_k_stderr_mean"] = statistics.fmean(
                r["eval/avg_at_k_stderr"] for r in rows
            )
            n = rows[0].get("eval/samples", 0)
            if n > rows[0]["eval/k"] and all(f"eval/pass_at_{n}" in r for r in rows):
                point[f"pass_at_{n}"] = spread([r[f"eval/pass_at_{n}"] for r in rows])
        if all("eval/format_rate" in r for r in rows):
            point["format_rate"] = spread([r["eval/format_rate"] for r in rows])
        curve.append(point)
    k = next((r["eval/k"] for e in evals.values() for r in e.values() if "eval/k" in r), None)
    return {
        "name": name,
        "flags": flags,
        "seeds": sorted(seeds),
        "k": k,
        "curve": curve,
        "wall_s": {str(s): round(w, 1) for s, w in wall.items()},
    }


def plot(summary: dict, seeds: dict[int, list[dict]], out: Path) -> Path:
    """NAME.png (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curve, k = summary["curve"], summary["k"]
    xs = [p["version"] for p in curve]
    if all("avg_at_k" in p for p in curve):
        ax.errorbar(
            xs,
            [p["avg_at_k"]["mean"] for p in curve],
            [p["avg_at_k"]["std"] for p in curve],
            fmt="s-",
            capsize=4,
            color="tab:blue",
            label=f"avg@{k}, mean +- std over {len(seeds)} seeds",
        )
        for recs in seeds.values():
            ev = sorted(
                (r["eval/version"], r["eval/avg_at_k"]) for r in recs if "eval/avg_at_k" in r
            )
            ax.plot(*zip(*ev), color="tab:blue", alpha=0.25, linewidth=1)
    ax.errorbar(
        xs,
        [p["greedy"]["mean"] for p in curve],
        [p["greedy"]["std"] for p in curve],
        fmt="o--",
        capsize=4,
        color="tab:orange",
        label="greedy accuracy, mean +- std",
    )
    base = next(
        (p for p in curve if p["version"] == 0 and any(x.startswith("pass_at_") for x in p)), None
    )
    if base:
        key = next(x for x in base if x.startswith("pass_at_"))
        ax.axhline(
            base[key]["mean"],
            color="gray",
            linestyle=":",
            label=f"base model {key.replace('_at_', '@')}",
        )
    ax.set(
        xlabel="weight version (trainer steps)",
        ylabel="held-out",
        ylim=(0, 1.02),
        title=summary["name"],
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def load(name: str) -> tuple[dict, dict[int, list[dict]]]:
    """A saved summary and its seeds' kept records."""
    summary = json.loads((RESULTS / f"{name}.json").read_text())
    return summary, {s: records(RESULTS / f"{name}_s{s}.jsonl") for s in summary["seeds"]}


def compare(names: list[str], out: str) -> str:
    """The sweep table (markdown; also written to OUT.md) and OUT.png: mean avg@k (else
    greedy) of each name against version, error bars of +- one standard deviation over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lines = [
        "| name | flags | seeds | final avg@k | best avg@k (version) | final greedy | wall (min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        summary, _ = load(name)
        curve = summary["curve"]
        metric = "avg_at_k" if all("avg_at_k" in p for p in curve) else "greedy"
        best = max(curve, key=lambda p: p[metric]["mean"])
        last = curve[-1]
        wall = statistics.fmean(summary["wall_s"].values()) / 60
        lines.append(
            f"| {name} | `{' '.join(summary['flags']) or '(defaults)'}` | {len(summary['seeds'])} | "
            f"{last[metric]['mean']:.3f} +- {last[metric]['std']:.3f} | "
            f"{best[metric]['mean']:.3f} (v{best['version']}) | "
            f"{last['greedy']['mean']:.3f} +- {last['greedy']['std']:.3f} | {wall:.1f} |"
        )
        ax.errorbar(
            [p["version"] for p in curve],
            [p[metric]["mean"] for p in curve],
            [p[metric]["std"] for p in curve],
            fmt="o-",
            capsize=3,
            label=name,
        )
    ax.set(
        xlabel="weight version (trainer steps)",
        ylabel="held-out avg@k, mean +- std over seeds",
        ylim=(0, 1.02),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{out}.png", dpi=110)
    plt.close(fig)
    table = "\n".join(lines)
    (RESULTS / f"{out}.md").write_text(table + "\n")
    return table


def earlier(name: str, flags: list[str]) -> tuple[dict[int, list[dict]], dict[int, float]]:
    """The seeds already saved under `name` with the same flags (kept records, wall
    seconds), so a later call adds seeds to them; none when there are none or the flags
    differ (the new runs replace them)."""
    if not (RESULTS / f"{name}.json").exists():
        return {}, {}
    summary, seeds = load(name)
    if summary["flags"] != flags:
        print(
            f"{name}: the saved seeds ran with other flags ({' '.join(summary['flags'])}): replaced"
        )
        return {}, {}
    return seeds, {int(s): w for s, w in summary["wall_s"].items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "name",
        nargs="?",
        help="name of this configuration (files NAME_sS.jsonl, NAME.json, NAME.png)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--plot-only", action="store_true", help="summarize and plot the saved runs again"
    )
    p.add_argument(
        "--compare", nargs="+", metavar="NAME", help="table and plot of saved configurations"
    )
    p.add_argument("--out", default="compare", help="file name of --compare's table and plot")
    p.add_argument(
        "--fully-async",
        action="store_true",
        help="each seed as an explorer (--mode explore) and a trainer (--mode train) launched at once",
    )
    args, flags = p.parse_known_args()
    flags = [f for f in flags if f != "--"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.compare:
        print(compare(args.compare, args.out))
        return
    if not args.name:
        p.error("give a NAME (or --compare NAMES)")
    if args.plot_only:
        summary, seeds = load(args.name)
    else:
        # the seeds' record names the launches too, so a later call adds to runs of the same kind
        recorded = ["--fully-async", *flags] if args.fully_async else flags
        seeds, wall = earlier(args.name, recorded)
        for s in args.seeds:
            run_dir = ROOT / "runs" / "seeds" / f"{args.name}_s{s}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            log = run_dir.parent / f"{args.name}_s{s}.log"
            wall[s] = run_job(run_dir, flags, s, log, args.fully_async)
            seeds[s] = keep(records(run_dir / "metrics.jsonl"))
            (RESULTS / f"{args.name}_s{s}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in seeds[s])
            )
            print(f"seed {s}: {wall[s] / 60:.1f} min", flush=True)
        summary = summarize(args.name, seeds, recorded, wall)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    for point in summary["curve"]:
        avg = point.get("avg_at_k")
        print(
            f"version {point['version']:>3}: greedy {point['greedy']['mean']:.3f} +- {point['greedy']['std']:.3f}"
            + (f", avg@{summary['k']} {avg['mean']:.3f} +- {avg['std']:.3f}" if avg else "")
        )
    print(f"plot: {plot(summary, seeds, RESULTS / f'{args.name}.png')}")


if __name__ == "__main__":
    main()
