"""A run's numbers: RUN_DIR/metrics.jsonl (`Metrics`) and the trackers it writes to
(`TensorBoardLog`, the default; the others are handed over by the composition root), the
evaluation's statistics (`sampled_eval`, `pass_at_k`), and RUN_DIR/plot.png (`plot`)."""

import contextlib
import json
import math
import numbers
import os
from pathlib import Path
from typing import Callable


def print0(*args) -> None:
    """print on rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (GiB; Linux's ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its children (the explorer) so far."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a child that just ended
            t = p.cpu_times()
            total += t.user + t.system
    return total


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n samples, c correct: 1 - C(n - c, k) / C(n, k) (Chen et al.,
    arXiv:2107.03374, eq. 1)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_stderr(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error) of per-task mean scores (Miller, "Adding Error Bars to Evals",
    arXiv:2411.00640)."""
    if not xs:
        raise ValueError("mean_stderr of no scores")
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    return mean, math.sqrt(var / len(xs))


def learnable_groups(correct: list[int], n: int, group_size: int) -> float:
    """Expected fraction of groups of `group_size` whose rewards are not all equal: the mean of
    1 - p^g - (1 - p)^g over tasks, p^g estimated by C(c, g) / C(n, g) where n >= g, else (c / n)^g;
    correct[i]: task i's c of n."""

    def all_same(c: int) -> float:
        if n >= group_size:
            same = math.comb(c, group_size) + math.comb(n - c, group_size)
            return same / math.comb(n, group_size)
        return (c / n) ** group_size + (1 - c / n) ** group_size

    return sum(1 - all_same(c) for c in correct) / len(correct)


LEARNABLE_MIN = 0.25  # below: most groups give no advantage, so most steps learn nothing


def sampled_eval(correct: list[int], n: int, k: int, group_size: int = 0) -> dict[str, float]:
    """eval/* of n samples per task, correct[i] right for task i: avg_at_k, stderr, pass_at_J,
    learnable_groups."""
    if n < k or not correct:
        raise ValueError(f"sampled_eval needs n >= k and tasks: n={n}, k={k}, {len(correct)} tasks")
    avg, err = mean_stderr([c / n for c in correct])
    out = {"eval/avg_at_k": avg, "eval/avg_at_k_stderr": err, "eval/k": k, "eval/samples": n}
    for j in sorted({2**i for i in range(n.bit_length())} | {n}):
        out[f"eval/pass_at_{j}"] = sum(pass_at_k(n, c, j) for c in correct) / len(correct)
    if group_size >= 2:
        out["eval/learnable_groups"] = learnable_groups(correct, n, group_size)
    return out


def eval_line(r: dict, group_size: int = 0) -> str:
    """Lines for an evaluation record, with what to try where learnable_groups is below
    LEARNABLE_MIN."""
    line = (
        f"held-out accuracy {r['eval/accuracy']:.3f} "
        f"+- {r.get('eval/accuracy_stderr', 0):.3f} (greedy)"
    )
    if "eval/avg_at_k" in r:
        line += f", avg@{r['eval/k']} {r['eval/avg_at_k']:.3f} +- {r['eval/avg_at_k_stderr']:.3f}"
    if "eval/format_rate" in r:
        line += f", format {r['eval/format_rate']:.2f}"
    if (n := r.get("eval/samples", 0)) > r.get("eval/k", 0):
        line += f", pass@{n} {r[f'eval/pass_at_{n}']:.3f}"
    if r.get("eval/cached"):
        line += " (cached: the same weights, tasks and settings were evaluated before)"
    if (f := r.get("eval/learnable_groups")) is not None:
        line += f", learnable groups {f:.0%}"
        if f < LEARNABLE_MIN:
            line += (
                f"\nwarning: only {f:.0%} of groups of {group_size or 'this size'} are expected "
                "to have rewards that differ, the rest give no advantage and no gradient: try a "
                "larger --group-size, an easier --task-kwargs, a warm start by SFT (--mode train "
                "--train-data), --difficulty-filter or --selector diff_based"
            )
    return line


def json_safe(x):
    """NaN and infinities become null (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return [json_safe(v) for v in x] if isinstance(x, (list, tuple)) else x


class TensorBoardLog:
    """Scalars as TensorBoard event files in RUN_DIR/tensorboard
    (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.writer.add_text(
            "config", "    " + json.dumps(config, indent=2).replace("\n", "\n    ")
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def plot(run_dir: Path) -> Path:
    """Draw RUN_DIR/metrics.jsonl into RUN_DIR/plot.png (`figure`); returns its path."""
    recs = [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    figure(recs, run_dir.name).savefig(out := run_dir / "plot.png", dpi=100)
    return out


def eval_curves(ax, evals: list[dict]) -> None:
    """Greedy accuracy, avg@k (+- 1 s.e.), format rate and the base model's pass@J against
    version."""
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
    """The Figure of metric records `recs`: reward, accuracy, length, losses, entropy, grad norm
    against step."""
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


class JsonlLog:
    """Appends records to a JSONL file; with `keep` (a resume), drops the records where keep(record)
    is False first."""

    def __init__(self, path: Path, keep: Callable[[dict], bool] | None = None):
        if keep is not None and path.is_file():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # blank, or half-written when the run was killed
                    continue
                if isinstance(record, dict) and keep(record):
                    kept.append(line + "\n")
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self.file = path.open("a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class Metrics(JsonlLog):
    """Rank 0's log: each record to RUN_DIR/metrics.jsonl, its finite numbers to `trackers`
    (objects with `log(scalars, step)` and `close()`, such as TensorBoardLog). `keep`: as
    JsonlLog's."""

    def __init__(
        self, run_dir: Path, trackers: list = (), keep: Callable[[dict], bool] | None = None
    ):
        super().__init__(run_dir / "metrics.jsonl", keep)
        self.trackers = list(trackers)

    def write(self, record: dict) -> None:
        super().write(record)
        scalars = {
            k: float(v)
            for k, v in record.items()
            if k != "step" and isinstance(v, numbers.Real) and math.isfinite(v)
        }
        for t in self.trackers:
            t.log(scalars, int(record["step"]))

    def close(self) -> None:
        super().close()
        for t in self.trackers:
            t.close()


# ----------------------------------------------------------------------------- a training step's


def reward_metrics(rewards) -> dict[str, float]:
    """reward/mean and reward/std of the rollouts' rewards [n] (none of no rollouts)."""
    if not len(rewards):
        return {}
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
    }


def accumulate(sums: dict, micro_batch: dict) -> None:
    """Add a micro-batch's metric sums (name -> 0-dim tensor on the trainer's device: no wait
    for the device per micro-batch) into `sums` in float64; extremes (`*_max`, `*_min`) are
    kept."""
    import torch

    for k, v in micro_batch.items():
        v = v.double()
        if k not in sums:
            sums[k] = v
        elif k.endswith("_max"):
            sums[k] = torch.maximum(sums[k], v)
        elif k.endswith("_min"):
            sums[k] = torch.minimum(sums[k], v)
        else:
            sums[k] = sums[k] + v


def micro_batch_sums(share, lp, behaviour, entropy, mask, offline, terms: dict) -> dict:
    """Trainer.forward_backward's metrics of one micro-batch, 0-dim tensors on its device (no
    wait for the device per micro-batch): "loss/policy" (`share`, its part of the policy loss),
    each per-token metric summed over the trained tokens (the policy's and behaviour's
    log-probs `lp`, `behaviour`, `entropy`, `mask` [B, R]; `terms`: name -> [B, R] of the loss
    and the scorers), "tokens", and the importance ratio's extremes. `offline` [B]: expert
    sequences, which have no behaviour log-probs."""
    import torch

    from losses import kl_estimate, masked_sum

    rollout = ~offline[:, None]  # [B, 1]
    log_ratio = lp - behaviour  # [B, R]
    ratio = torch.exp(log_ratio.clamp(-20, 20))  # [B, R]
    parts = {
        "loss/entropy": entropy,
        "loss/kl_behaviour": kl_estimate(behaviour, lp, "k3") * rollout,
        "loss/logprob_abs_diff": log_ratio.abs() * rollout,
        "loss/ratio_mean": ratio * rollout,
        # the losses clamp the log-ratio to +-20 (as verl): a token beyond trains wrong
        "loss/log_ratio_clamped": (log_ratio.abs() > 20) * rollout,
        **terms,
    }
    # no boolean index: its size would wait for the device
    rated = (mask * rollout) > 0  # [B, R]
    return {
        "loss/policy": share,
        **{k: masked_sum(v.float(), mask) for k, v in parts.items()},
        "tokens": mask.sum(),
        "loss/ratio_max": torch.where(rated, ratio, -math.inf).max(),
        "loss/ratio_min": torch.where(rated, ratio, math.inf).min(),
    }


def step_metrics(
    batch,
    adv,
    keep,
    filtered: dict[str, int],
    *,
    grad_norm: float,
    lr: float,
    micro_batches: int,
    train_s: float,
    computed_tokens: int,
    device,
) -> dict[str, float]:
    """Trainer.step's metrics beside its reduced loss sums, of its global batch `batch` (a
    trainer.StepBatch) with advantages `adv` [N], the sequences the filters kept (`keep` [N],
    `filtered`: filter/<name> -> how many it dropped), and the step's own numbers; the peak
    memory of this process (and of its GPU, on `device` cuda)."""
    import torch

    m = {}
    if (rollout := ~batch.offline).any():
        m["advantage/mean"] = float(adv[rollout].mean())
        m["advantage/abs_mean"] = float(adv[rollout].abs().mean())
    lengths = [len(e.behaviour_logprobs) for e in batch.exps]
    tokens = sum(len(e.tokens) for e in batch.exps)
    m.update(
        {
            **filtered,
            "loss/grad_norm": grad_norm,
            "train/lr": lr,
            "filter/kept": int(keep.sum()),
            "train/expert_seqs": int(batch.offline.sum()),
            "train/micro_batches": micro_batches,
            "response/len_mean": sum(lengths) / len(lengths),
            "response/len_max": max(lengths),
            "time/train_s": train_s,
            "train/tokens_per_s": tokens / train_s,
            "train/computed_tokens": computed_tokens,
            "train/sequence_tokens": tokens,
            "memory/trainer_peak_rss_gib": peak_rss_gib(),
        }
    )
    if device.type == "cuda":
        m["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        m["memory/reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
    return m
