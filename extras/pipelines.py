"""Data pipelines (Trinity-RFT, arXiv:2505.17826 section 2.3) of operators {op = NAME, ...kwargs}:
fn(tasks: list[Task], ctx: TaskContext, **kw) -> list[Task]
fn(groups: list[list[Experience]], ctx: ExperienceContext, **kw) -> list[list[Experience]]"""

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from buffer import COLUMNS, Buffer, Experience
from losses import resolve
from workflows import Shuffle, Task

TASK_OPS: dict[str, Callable | str] = {
    name: f"extras.task_ops.{name}"
    for name in (
        "dedup",
        "length_filter",
        "metadata_difficulty",
        "pass_rate_difficulty",
        "model_difficulty",
    )
}
EXPERIENCE_OPS: dict[str, Callable | str] = {
    name: f"extras.experience_ops.{name}"
    for name in ("quality_reward", "diversity_reward", "clean")
}
SELECTORS: dict[str, type | str] = {
    "shuffle": Shuffle,
    **{
        name: f"extras.selectors.{cls}"
        for name, cls in (
            ("sequential", "Sequential"),
            ("random", "RandomTasks"),
            ("easy2hard", "Easy2Hard"),
            ("diff_based", "DiffBased"),
        )
    },
}
# cfg -> None: raises for a bad annotation setting
ANNOTATION_CHECK = "extras.label_studio.check_annotation"


@dataclass
class TaskContext:
    """What a task operator may use; rollouts(tasks, n) -> a group (None: skipped) per task, by the
    explorer."""

    tokenizer: Any = None
    rollouts: Callable[[list[Task], int], list] | None = None
    metrics: dict = field(default_factory=dict)


@dataclass
class ExperienceContext:
    """What an experience operator may use: the batch's trainer step, the policy's tokenizer and
    model."""

    step: int = 0
    tokenizer: Any = None
    model: str = ""
    metrics: dict = field(default_factory=dict)


def parse_ops(specs: list, registry: dict, what: str) -> list[tuple[str, Callable, dict]]:
    """[(name, fn, kwargs)] of a configured list [{"op": NAME, **kwargs}]; ValueError (one line) for
    a bad entry."""
    if not isinstance(specs, list):
        raise ValueError(f"{what}: expected a list of tables {{op = NAME, ...}}, got {specs!r}")
    out = []
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("op"), str):
            raise ValueError(f"{what}: each entry needs op = NAME, got {spec!r}")
        kwargs = {k: v for k, v in spec.items() if k != "op"}
        out.append((spec["op"], resolve(spec["op"], registry, what, kwargs), kwargs))
    return out


def _label(name: str) -> str:
    return name.rpartition(".")[2]


def run_task_pipeline(specs: list, tasks: list[Task], ctx: TaskContext) -> list[Task]:
    """Apply the task operators in order (metrics pipeline/<op>/kept, removed); ValueError when none
    is left."""
    for name, fn, kwargs in parse_ops(specs, TASK_OPS, "task_pipeline"):
        before = len(tasks)
        tasks = fn(tasks, ctx, **kwargs)
        ctx.metrics.update(
            {
                f"pipeline/{_label(name)}/kept": len(tasks),
                f"pipeline/{_label(name)}/removed": before - len(tasks),
            }
        )
        if not tasks:
            raise ValueError(f"task_pipeline: {name} removed every task")
    return tasks


def curate(explorer, buffer: Buffer) -> tuple[list[Task], dict]:
    """(The explorer's training tasks after cfg.task_pipeline, its metrics), kept in the buffer's
    run state."""
    cfg, key = explorer.cfg, f"tasks/{explorer.cfg.explorer_name}"
    if saved := buffer.run_state(key):
        by_id = {t.task_id: t for t in explorer.train}
        return [dataclasses.replace(by_id[i], difficulty=d) for i, d in json.loads(saved)], {}
    ctx = TaskContext(explorer.engine.tokenizer, lambda tasks, n: explorer.rollout(tasks, n=n))
    tasks = run_task_pipeline(cfg.task_pipeline, explorer.train, ctx)
    buffer.set_run_state(key, json.dumps([[t.task_id, t.difficulty] for t in tasks]))
    print(
        f"explorer {cfg.explorer_name}: task pipeline kept {len(tasks)} of "
        f"{len(explorer.train)} tasks",
        flush=True,
    )
    return tasks, ctx.metrics


def make_selector(name: str, kwargs: dict, tasks: list[Task], seed: int):
    """The selector `name` (SELECTORS, or module.Class(tasks, seed, **kwargs)); ValueError for a bad
    one."""
    return resolve(name, SELECTORS, "selector", kwargs)(tasks, seed, **kwargs)


def shape(e: Experience, op: str, bonus: float) -> None:
    """Add `bonus` to e.reward, recorded in info["shaping"][op] (info["reward_raw"]: before any
    shaping)."""
    e.info.setdefault("reward_raw", e.reward)
    e.info.setdefault("shaping", {})[op] = bonus
    e.reward = e.reward + bonus


class ExperiencePipeline:
    """(groups, step) -> (groups, metrics) of the experience operators, after `shape` (None:
    none; components.reader_and_log: Replay); RuntimeError when no group is left."""

    def __init__(self, specs: list, tokenizer=None, model: str = "", shape=None):
        self.ops = parse_ops(specs, EXPERIENCE_OPS, "experience_pipeline")
        self.tokenizer, self.model = tokenizer, model
        self.shape = shape

    def __call__(
        self, groups: list[list[Experience]], step: int
    ) -> tuple[list[list[Experience]], dict]:
        groups, m = self.shape(groups, step) if self.shape else (groups, {})
        ctx = ExperienceContext(step, self.tokenizer, self.model, m)
        for name, fn, kwargs in self.ops:
            before = len(groups)
            groups = [g for g in fn(groups, ctx, **kwargs) if g]
            ctx.metrics[f"pipeline/{_label(name)}/groups_dropped"] = before - len(groups)
            if not groups:
                raise RuntimeError(
                    f"experience_pipeline: {name} dropped every group of step {step}"
                )
        raw = [e.info.get("reward_raw", e.reward) for g in groups for e in g]
        ctx.metrics["pipeline/reward_raw_mean"] = sum(raw) / len(raw)
        return groups, ctx.metrics


def replay(
    buffer: Buffer, step: int, groups: int = 1, decay: float = 2.0, use_count_limit: int = 3
) -> tuple[list[list[Experience]], int]:
    """(Up to `groups` groups consumed before `step` by priority model_version - decay * use_count,
    how many were eligible). Reference: Trinity-RFT trinity/buffer/storage/queue.py @ 5a4234ec."""
    db = buffer.db
    with db.transaction(readers=True):
        eligible = db.execute(
            "SELECT group_id, MIN(model_version) - ? * MAX(use_count) AS priority FROM experiences "
            "WHERE consumed BETWEEN 1 AND ? GROUP BY group_id HAVING MAX(use_count) < ? "
            "ORDER BY priority DESC, MIN(id) DESC",
            (decay, step, use_count_limit),
        ).fetchall()
        ids, priority = [g for g, _ in eligible[:groups]], dict(eligible[:groups])
        if not ids:
            return [], len(eligible)
        marks = ",".join("?" * len(ids))
        rows = db.execute(
            f"SELECT {COLUMNS}, use_count FROM experiences WHERE group_id IN ({marks}) ORDER BY id",
            ids,
        ).fetchall()
        db.execute(
            f"UPDATE experiences SET use_count = use_count + 1 WHERE group_id IN ({marks})", ids
        )
        db.executemany("INSERT INTO replays VALUES (?, ?)", [(step, g) for g in ids])
    out = buffer.groups_of(ids, [r[:-1] for r in rows])
    uses = {r[0]: r[-1] for r in rows}
    for g in out:
        for e in g:
            e.info.update(use_count=uses[e.group_id], priority=float(priority[e.group_id]))
    return out, len(eligible)


class Replay:
    """(groups, step) -> (groups, metrics): the step's groups, then `replay`'s (cfg.replay: its
    keyword arguments). The first shaping of a batch (components.reader_and_log), so the experience
    pipeline and --expert-data's mixing see the replayed groups too."""

    def __init__(self, buffer: Buffer, kwargs: dict):
        self.buffer = buffer
        self.kwargs = kwargs

    def __call__(
        self, groups: list[list[Experience]], step: int
    ) -> tuple[list[list[Experience]], dict]:
        again, eligible = replay(self.buffer, step, **self.kwargs)
        n = max(1, len(again))
        m = {
            "replay/groups": len(again),
            "replay/eligible_groups": eligible,
            "replay/use_count_mean": sum(g[0].info["use_count"] for g in again) / n,
            "replay/priority_mean": sum(g[0].info["priority"] for g in again) / n,
        }
        return groups + again, m


def response_text(e: Experience, tokenizer) -> str:
    """The policy's part of a response (action_mask 1 tokens), decoded."""
    resp = e.tokens[e.prompt_length :]
    return tokenizer.decode(
        [t for t, m in zip(resp, e.action_mask) if m], skip_special_tokens=True
    ).strip()


def check_config(cfg) -> None:
    """ValueError (one line) for a bad pipeline, selector, replay or annotation setting;
    ConnectionError."""
    parse_ops(cfg.task_pipeline, TASK_OPS, "task_pipeline")
    parse_ops(cfg.experience_pipeline, EXPERIENCE_OPS, "experience_pipeline")
    selector = resolve(cfg.selector, SELECTORS, "selector", cfg.selector_kwargs)
    if hasattr(selector, "check_config"):
        selector.check_config(cfg)
    for name, value, known in (
        ("replay", cfg.replay, {"groups", "decay", "use_count_limit"}),
        (
            "annotation",
            cfg.annotation,
            {"url", "mode", "choices", "timeout_s", "timeout_reward", "project"},
        ),
    ):
        if set(value) - known:
            raise ValueError(
                f"{name}: unknown key(s) {sorted(set(value) - known)}; known: {sorted(known)}"
            )
    r = cfg.replay
    if r and not (
        isinstance(r.get("groups", 1), int)
        and r.get("groups", 1) >= 1
        and r.get("use_count_limit", 3) >= 2
        and r.get("decay", 2.0) >= 0
    ):
        raise ValueError(
            f"replay: need groups >= 1 (an integer), use_count_limit >= 2 and decay >= 0, got {r}"
        )
    if cfg.annotation:
        resolve(ANNOTATION_CHECK, {}, "annotation")(cfg)
