"""RUN_DIR/plot.png: a run's metric records drawn against the trainer step (matplotlib)."""

import json
from pathlib import Path


def plot(run_dir: Path) -> Path:
    """Draw RUN_DIR/metrics.jsonl into RUN_DIR/plot.png (`figure`); returns its path."""
    recs = [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    figure(recs, run_dir.name).savefig(out := run_dir / "plot.png", dpi=100)
    return out


def eval_curves(ax, evals: list[dict]) -> None:
    """Greedy accuracy, avg@k (+- 1 s.e.), format rate and the base model's pass@J against version."""
    ax.errorbar(
        [r["eval/version"] for r in evals],
        [r["eval/accuracy"] for r in evals],
        [r.get("eval/accuracy_stderr", 0) for r in evals],
        fmt="o-",
        capsize=3,
        label="held-out accuracy (greedy)",
    )
    if sampled := [r for r in evals if "eval/avg_at_k" in r]:
        ax.errorbar(
            [r["eval/version"] for r in sampled],
            [r["eval/avg_at_k"] for r in sampled],
            [r["eval/avg_at_k_stderr"] for r in sampled],
            fmt="s-",
            capsize=3,
            label=f"held-out avg@{sampled[0]['eval/k']} (+- 1 s.e.)",
        )
    if fmt := [r for r in evals if "eval/format_rate" in r]:
        ax.plot(
            [r["eval/version"] for r in fmt],
            [r["eval/format_rate"] for r in fmt],
            "^--",
            alpha=0.6,
            label="format rate (greedy)",
        )
    if base := [
        r for r in evals if r["eval/version"] == 0 and r.get("eval/samples", 0) > r.get("eval/k", 0)
    ]:
        n = base[0]["eval/samples"]
        ax.axhline(
            base[0][f"eval/pass_at_{n}"], color="gray", linestyle=":", label=f"base model pass@{n}"
        )


def figure(recs: list[dict], title: str = ""):
    """The Figure of metric records `recs`: reward, accuracy, length, losses, entropy, grad norm against step."""
    from matplotlib.figure import Figure

    steps = [r for r in recs if "loss/grad_norm" in r]
    evals = [r for r in recs if r.get("eval/accuracy") is not None]
    fig = Figure(figsize=(12, 7))
    axes = fig.subplots(2, 2)

    def curve(ax, key, label, **kw):
        xs = [(r["step"], r[key]) for r in steps if r.get(key) is not None]
        if xs:
            ax.plot(*zip(*xs), label=label, **kw)
        return bool(xs)

    ax = axes[0, 0]
    rewards = curve(ax, "reward/mean", "train reward (mean)", alpha=0.7)
    if evals:
        eval_curves(ax, evals)
    if rewards or evals:
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("reward and held-out accuracy" if rewards else "held-out accuracy")
    else:  # offline data (SFT, DPO): no rollouts to reward, no evaluations
        curve(ax, "loss/policy", "training loss", color="tab:red")
        curve(ax, "loss/pair_correct", "pairs ranked right (DPO)", color="tab:purple")
        ax.set_title("training loss (offline data: no rewards)")
    curve(axes[0, 1], "response/len_mean", "mean response length (tokens)", color="tab:green")
    axes[0, 1].set_title("response length (tokens)")
    curve(axes[1, 0], "loss/policy", "policy loss")
    curve(axes[1, 0], "loss/kl_ref", "KL to reference")
    curve(axes[1, 0], "loss/kl_behaviour", "KL to behaviour policy")
    axes[1, 0].set_title("loss")
    curve(axes[1, 1], "loss/entropy", "token entropy (nats)")
    curve(axes[1, 1], "loss/grad_norm", "grad norm (before clipping)")
    axes[1, 1].set_title("entropy and gradient norm")
    for a in axes.flat:
        a.set_xlabel("trainer step (weight version)")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
