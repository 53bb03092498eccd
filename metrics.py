"""A run's numbers: RUN_DIR/metrics.jsonl (`Metrics`), trackers (TRACKERS; their adapters in extras/),
the evaluation's statistics (`sampled_eval`, `pass_at_k`); plot.png is extras/plot.py's."""

import contextlib
import dataclasses
import importlib.util
import json
import math
import numbers
import os
from pathlib import Path
from typing import Callable

from losses import resolve


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
    """Unbiased pass@k of n samples, c correct: 1 - C(n - c, k) / C(n, k) (Chen et al., arXiv:2107.03374, eq. 1)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_stderr(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error) of per-task mean scores (Miller, "Adding Error Bars to Evals", arXiv:2411.00640)."""
    if not xs:
        raise ValueError("mean_stderr of no scores")
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    return mean, math.sqrt(var / len(xs))


def learnable_groups(correct: list[int], n: int, group_size: int) -> float:
    """Expected fraction of groups of `group_size` whose rewards are not all equal: the mean of 1 - p^g - (1 - p)^g
    over tasks, p^g estimated by C(c, g) / C(n, g) where n >= g, else (c / n)^g; correct[i]: task i's c of n."""

    def all_same(c: int) -> float:
        if n >= group_size:
            same = math.comb(c, group_size) + math.comb(n - c, group_size)
            return same / math.comb(n, group_size)
        return (c / n) ** group_size + (1 - c / n) ** group_size

    return sum(1 - all_same(c) for c in correct) / len(correct)


LEARNABLE_MIN = 0.25  # below: most groups give no advantage, so most steps learn nothing


def sampled_eval(correct: list[int], n: int, k: int, group_size: int = 0) -> dict[str, float]:
    """eval/* of n samples per task, correct[i] right for task i: avg_at_k, stderr, pass_at_J, learnable_groups."""
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
    """Lines for an evaluation record, with what to try where learnable_groups is below LEARNABLE_MIN."""
    line = f"held-out accuracy {r['eval/accuracy']:.3f} +- {r.get('eval/accuracy_stderr', 0):.3f} (greedy)"
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
                f"\nwarning: only {f:.0%} of groups of {group_size or 'this size'} are expected to have rewards "
                "that differ, the rest give no advantage and no gradient: try a larger --group-size, an easier "
                "--task-kwargs, a warm start by SFT (--mode train --train-data), --difficulty-filter or --selector diff_based"
            )
    return line


def json_safe(x):
    """NaN and infinities become null (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    return [json_safe(v) for v in x] if isinstance(x, (list, tuple)) else x


# name -> the adapter's import path (imported only when a run logs to it)
TRACKERS = {
    "tensorboard": "extras.tensorboard_log.TensorBoardLog",
    "wandb": "extras.wandb_log.WandbLog",
    "mlflow": "extras.mlflow_log.MLflowLog",
}
PIP = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny sqlalchemy alembic"}


def trackers(cfg) -> list[str]:
    """The trackers named by cfg.log. ValueError (one line): an unknown one, or its package missing."""
    names = [x.strip() for x in cfg.log.split(",") if x.strip() and x.strip() != "none"]
    for name in names:
        if name not in TRACKERS:
            raise ValueError(
                f"--log: unknown tracker {name!r} (choose from {', '.join(TRACKERS)}, or none)"
            )
        if name in PIP and importlib.util.find_spec(name) is None:
            raise ValueError(
                f"--log {name}: the {name} package is not installed (pip install {PIP[name]})"
            )
    return names


class JsonlLog:
    """Appends records to a JSONL file; with `keep` (a resume), drops the records where keep(record) is False first."""

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
    """Rank 0's log: each record to RUN_DIR/metrics.jsonl, its finite numbers to the trackers. `keep`: as JsonlLog's."""

    def __init__(self, run_dir: Path, cfg=None, keep: Callable[[dict], bool] | None = None):
        super().__init__(run_dir / "metrics.jsonl", keep)
        names = trackers(cfg) if cfg else []
        self.trackers = [
            resolve(TRACKERS[name], {}, "tracker")(run_dir, dataclasses.asdict(cfg))
            for name in names
        ]

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
