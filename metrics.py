"""Where a run's numbers go: RUN_DIR/metrics.jsonl (always), the experiment trackers of
--log (TensorBoard here; W&B and MLflow in extras/, imported only when asked for) and
RUN_DIR/plot.png. Used by trainer rank 0 (`Metrics`) and by `--mode explore` launches
(`JsonlLog`, RUN_DIR/explorer_NAME.jsonl). A file of its own (the design card gives trackers
and the plot a home outside run.py): the loop, the explorer and run.py all write here.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
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
    """This process's peak resident memory (GiB) so far (getrusage; Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process and its children (the
    explorer of mode both): cpu/utilisation_pct = 100 x its growth / wall seconds, so 200
    means two cores busy."""
    import psutil

    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a child that just ended
            pass
    return total


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task from n samples with c correct: 1 - C(n - c, k) / C(n, k).
    Source: Chen et al., "Evaluating Large Language Models Trained on Code",
    arXiv:2107.03374, section 2.1, eq. 1."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_stderr(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-task scores: sample standard deviation
    (n - 1) / sqrt(n), 0 for a single task. Scores of the k samples of one task are averaged
    first (the task is the unit), the clustered standard error of Miller, "Adding Error Bars
    to Evals", arXiv:2411.00640, section 2. Raises ValueError for an empty list."""
    if not xs:
        raise ValueError("mean_stderr of no scores")
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def sampled_eval(correct: list[int], n: int, k: int) -> dict[str, float]:
    """The eval/* metrics of n samples per held-out task with correct[i] right answers for
    task i: eval/avg_at_k (avg@k, the mean over tasks of c_i / n: with n = k samples the
    mean accuracy of k samples per task, with more an unbiased estimate of the same),
    eval/avg_at_k_stderr (`mean_stderr`), eval/k = k, eval/samples = n, and
    eval/pass_at_J (`pass_at_k`) for J = 1, 2, 4, ... up to n (n itself included).
    Raises ValueError when n < k or there are no tasks."""
    if n < k or not correct:
        raise ValueError(f"sampled_eval needs n >= k and tasks (n={n}, k={k}, {len(correct)} tasks)")
    avg, err = mean_stderr([c / n for c in correct])
    out = {"eval/avg_at_k": avg, "eval/avg_at_k_stderr": err, "eval/k": k, "eval/samples": n}
    for j in sorted({2 ** i for i in range(n.bit_length())} | {n}):
        out[f"eval/pass_at_{j}"] = sum(pass_at_k(n, c, j) for c in correct) / len(correct)
    return out


def episode_means(infos: list[dict], prefix: str) -> dict[str, float]:
    """{prefix + NAME: mean} of the metrics that episodes recorded themselves (info["metrics"],
    e.g. an agent's tool calls: extras/agent.py), each over the episodes that recorded it; the
    samples of one trajectory (same info["trajectory_id"]) count once."""
    seen, sums = set(), {}
    for info in infos:
        episode = info.get("trajectory_id", id(info))
        if "metrics" not in info or episode in seen:
            continue
        seen.add(episode)
        for k, v in info["metrics"].items():
            total, n = sums.get(k, (0.0, 0))
            sums[k] = (total + v, n + 1)
    return {prefix + k: total / n for k, (total, n) in sums.items()}


def eval_line(r: dict) -> str:
    """One line for an evaluation record (`explorer.Explorer.evaluate`'s): greedy accuracy
    +- its standard error, avg@k +- its standard error, the format rate and, where
    measured (version 0), the largest pass@J."""
    line = f"held-out accuracy {r['eval/accuracy']:.3f} +- {r.get('eval/accuracy_stderr', 0):.3f} (greedy)"
    if "eval/avg_at_k" in r:
        line += f", avg@{r['eval/k']} {r['eval/avg_at_k']:.3f} +- {r['eval/avg_at_k_stderr']:.3f}"
    if "eval/format_rate" in r:
        line += f", format {r['eval/format_rate']:.2f}"
    n = r.get("eval/samples", 0)
    if n > r.get("eval/k", 0):
        line += f", pass@{n} {r[f'eval/pass_at_{n}']:.3f}"
    return line


def json_safe(x):
    """NaN and infinities become null (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return [json_safe(v) for v in x] if isinstance(x, (list, tuple)) else x


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
TRACKER_INSTALL = {"tensorboard": "pip install tensorboard", "wandb": "pip install wandb",
                   "mlflow": "pip install mlflow-skinny sqlalchemy alembic"}


def trackers(cfg) -> list[str]:
    """The trackers named by cfg.log. Raises ValueError (one line) for an unknown name or
    one whose package is not installed."""
    names = [x.strip() for x in cfg.log.split(",") if x.strip() and x.strip() != "none"]
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise ValueError(f"--log: unknown tracker {name!r} (choose from {', '.join(TRACKER_PACKAGES)}, or none)")
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ValueError(f"--log {name}: the {TRACKER_PACKAGES[name]} package is not installed ({TRACKER_INSTALL[name]})")
    return names


class TensorBoardLog:
    """Scalars as TensorBoard event files in RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, run_dir: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# name -> the adapter's import path (W&B and MLflow are optional: imported only when asked for)
TRACKERS = {"tensorboard": "metrics.TensorBoardLog", "wandb": "extras.wandb_log.WandbLog",
            "mlflow": "extras.mlflow_log.MLflowLog"}


def _adapter(name: str):
    """The tracker class registered as `name` in TRACKERS, imported on first use."""
    module, _, cls = TRACKERS[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


class JsonlLog:
    """Appends records to a JSONL file, each flushed at once (readable while the run goes
    on); NaN and infinities are written as null (JSON has none). With `keep` (a resume:
    loop.kept_on_resume), the records already in the file for which keep(record) is False
    are dropped first, and so is a line a kill cut short (the kept lines are written to a
    temporary file that is then renamed over the old one)."""

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


class Metrics:
    """Rank 0's metrics log: every record is appended to RUN_DIR/metrics.jsonl (always), and
    its finite numbers go to each tracker of cfg.log under the same namespaced keys
    ("reward/mean", "eval/accuracy", ...) at the record's `step`. Without trackers this is
    the JSONL file alone (nanochat's null-logger pattern: callers never check). `keep`: on
    a resume, which records already in metrics.jsonl stay (JsonlLog; the trackers' own
    files are not rewritten)."""

    def __init__(self, run_dir: Path, cfg=None, keep: Callable[[dict], bool] | None = None):
        self.jsonl = JsonlLog(run_dir / "metrics.jsonl", keep)
        config = dataclasses.asdict(cfg) if cfg else {}
        self.trackers = [_adapter(name)(run_dir, config) for name in (trackers(cfg) if cfg else [])]

    def write(self, record: dict) -> None:
        """Append one record (valid JSON: NaN is written as null) and flush (readable
        while the run goes on); send its finite numbers to the trackers."""
        self.jsonl.write(record)
        scalars = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, numbers.Real) and math.isfinite(v)}
        for t in self.trackers:
            t.log(scalars, int(record["step"]))

    def close(self) -> None:
        """Finish the tracker runs (W&B and MLflow mark them finished)."""
        self.jsonl.close()
        for t in self.trackers:
            t.close()


def plot(run_dir: Path) -> Path:
    """Plot RUN_DIR/metrics.jsonl against trainer step into RUN_DIR/plot.png (`figure`);
    returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    fig = figure(recs, run_dir.name)
    out = run_dir / "plot.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def eval_curves(ax, evals: list[dict]) -> None:
    """Draw evaluation records on `ax` against weight version: greedy accuracy, avg@k with
    error bars of +- one standard error, the format rate (dashed) and the base model's
    largest pass@J measured at version 0 (a horizontal line: RL of this kind mostly moves
    pass@1 towards it, unless, as in the default job, the base model fails on form)."""
    versions = [r["eval/version"] for r in evals]
    ax.errorbar(versions, [r["eval/accuracy"] for r in evals], [r.get("eval/accuracy_stderr", 0) for r in evals],
                fmt="o-", capsize=3, label="held-out accuracy (greedy)")
    sampled = [r for r in evals if "eval/avg_at_k" in r]
    if sampled:
        ax.errorbar([r["eval/version"] for r in sampled], [r["eval/avg_at_k"] for r in sampled],
                    [r["eval/avg_at_k_stderr"] for r in sampled], fmt="s-", capsize=3,
                    label=f"held-out avg@{sampled[0]['eval/k']} (+- 1 s.e.)")
    fmt = [r for r in evals if "eval/format_rate" in r]
    if fmt:
        ax.plot([r["eval/version"] for r in fmt], [r["eval/format_rate"] for r in fmt], "^--", alpha=0.6,
                label="format rate (greedy)")
    base = [r for r in evals if r["eval/version"] == 0 and r.get("eval/samples", 0) > r.get("eval/k", 0)]
    if base:
        n = base[0]["eval/samples"]
        ax.axhline(base[0][f"eval/pass_at_{n}"], color="gray", linestyle=":", label=f"base model pass@{n}")


def figure(recs: list[dict], title: str = ""):
    """The matplotlib Figure of `plot` for the metric records `recs` (metrics.jsonl's),
    2 x 2 panels against trainer step: train reward (rollouts only) and held-out accuracy
    (`eval_curves`),
    or, in a run without either (offline SFT / DPO data), the training loss (and DPO's pair
    accuracy); mean response length; policy loss and KL to the reference / behaviour
    policy; entropy and grad norm. Curves whose metric the run does not have are left
    out. The caller closes it (matplotlib.pyplot.close)."""
    import matplotlib.pyplot as plt

    steps = [r for r in recs if "loss/grad_norm" in r]
    evals = [r for r in recs if r.get("eval/accuracy") is not None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))

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


