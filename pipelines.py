"""Data pipelines: task curation and selection, experience shaping, human labels.

The third pillar of Trinity-RFT (technical report, arXiv:2505.17826, section 2.3 and
examples 3.4-3.5). A module of its own because its operators run in places that belong to
no single stage: on the task list before the loop and in the choice of the next tasks (the
explorer process), between the buffer and the trainer (trainer rank 0), and beside the run,
where human labels from Label Studio become lagged rewards (extras/label_studio.py).
This file holds the machinery (contexts, registries, the default selectors, the
experience pipeline, the checks); the bundled operators and the adaptive selectors live
in extras/ (task_ops.py, experience_ops.py, selectors.py), registered by import path and
imported only when a run names them.

Configured in the TOML (or as JSON flags) as lists of operators, each a table with "op"
(a name below, or an import path module.function: a plug-in) and its keyword arguments:

    task_pipeline = [{op = "dedup"}, {op = "length_filter", max_tokens = 64},
                     {op = "metadata_difficulty", keys = ["num_digits", "num_terms"]}]
    selector = "easy2hard"            # sequential, shuffle (default), random, easy2hard, diff_based
    experience_pipeline = [{op = "diversity_reward", weight = 0.5, final_weight = 0.3, decay_steps = 30}]
    replay = {groups = 4, decay = 2.0, use_count_limit = 3}     # buffer.Buffer.replay
    annotation = {url = "http://localhost:8080", token = "..."}   # with reward_fn = "human"

Task operator:       fn(tasks: list[Task], ctx: TaskContext, **kw) -> list[Task]
Experience operator: fn(groups: list[list[Experience]], ctx: ExperienceContext, **kw) -> list[list[Experience]]
Each records its metrics in ctx.metrics as pipeline/<op>/<name>. A shaping operator adds
its bonus to the reward and records it in info["shaping"][op] (the reward before any
shaping stays in info["reward_raw"]): the lineage of every reward is in the buffer's
samples and in the metrics.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from buffer import Experience
from losses import resolve
from workflows import Task

# name -> operator: the import paths of the bundled ones (extras/), imported only when a pipeline names them
TASK_OPS: dict[str, Callable | str] = {name: f"extras.task_ops.{name}" for name in (
    "dedup", "length_filter", "metadata_difficulty", "pass_rate_difficulty", "model_difficulty")}
EXPERIENCE_OPS: dict[str, Callable | str] = {name: f"extras.experience_ops.{name}" for name in (
    "quality_reward", "diversity_reward", "clean")}


@dataclass
class TaskContext:
    """What a task operator may use. tokenizer: the policy's; rollouts(tasks, n) -> one
    group (list of Experience with rewards) or None (skipped) per task, sampled by the
    explorer's engine and workflow at the run's temperature; metrics: filled by operators."""

    tokenizer: Any = None
    rollouts: Callable[[list[Task], int], list] | None = None
    metrics: dict = field(default_factory=dict)


@dataclass
class ExperienceContext:
    """What an experience operator may use. step: the trainer step (0-based) of the batch;
    tokenizer: the policy's; model: the run's model directory (the default embedding
    model); metrics: filled by operators."""

    step: int = 0
    tokenizer: Any = None
    model: str = ""
    metrics: dict = field(default_factory=dict)


def parse_ops(specs: list, registry: dict, what: str) -> list[tuple[str, Callable, dict]]:
    """[(name, fn, kwargs)] of a configured operator list [{"op": NAME, **kwargs}]. Raises
    ValueError (one line) for an entry that is not a table with "op", an unknown name or a
    keyword the operator does not take."""
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


# ----------------------------------------------------------------------------- task curation

def run_task_pipeline(specs: list, tasks: list[Task], ctx: TaskContext) -> list[Task]:
    """Apply the task operators in order; ctx.metrics gets pipeline/<op>/kept and /removed.
    Raises ValueError when an operator leaves no task."""
    for name, fn, kwargs in parse_ops(specs, TASK_OPS, "task_pipeline"):
        before = len(tasks)
        tasks = fn(tasks, ctx, **kwargs)
        ctx.metrics.update({f"pipeline/{_label(name)}/kept": len(tasks),
                            f"pipeline/{_label(name)}/removed": before - len(tasks)})
        if not tasks:
            raise ValueError(f"task_pipeline: {name} removed every task")
    return tasks


# ----------------------------------------------------------------------------- task selection

class Selector:
    """Chooses the indices of the next training tasks (Trinity-RFT
    trinity/buffer/selector/selector.py @ 3e9eb605: get_indices / update / state_dict).
    Subclasses give `order` (a cycled order) or override `next`. `update` receives each
    group's mean reward (the task's latest pass rate) as it comes back."""

    def __init__(self, tasks: list[Task], seed: int):
        self.tasks, self.seed, self.cursor = tasks, seed, 0
        self.order = list(range(len(tasks)))

    @staticmethod
    def check_config(cfg) -> None:
        """Raise ValueError (one line) for run settings (config.Config) this selector cannot
        work with; checked before any process starts."""

    def next(self, k: int) -> list[int]:
        """The next k indices of the cycled order."""
        out = [self.order[(self.cursor + i) % len(self.order)] for i in range(k)]
        self.cursor += k
        return out

    def update(self, pass_rates: dict[str, float]) -> None:
        """task_id -> mean reward of its latest group; unused by rule-based selectors."""

    def metrics(self) -> dict:
        """Metrics of the latest choice (namespaced selector/...)."""
        return {}

    def state(self) -> dict:
        """JSON-able resume state."""
        return {"cursor": self.cursor}

    def restore(self, state: dict) -> None:
        """Continue from a `state()`."""
        self.cursor = state["cursor"]


class Sequential(Selector):
    """The task list in its own order (after the task pipeline), cycled."""


class Shuffle(Selector):
    """A seeded permutation of the task list, cycled (nanorft's default order)."""

    def __init__(self, tasks: list[Task], seed: int):
        super().__init__(tasks, seed)
        self.order = random.Random(seed).sample(range(len(tasks)), len(tasks))


class RandomTasks(Selector):
    """k distinct tasks drawn uniformly for every request (Trinity-RFT's RandomSelector:
    a generator seeded by the running count of drawn tasks, so resume is exact)."""

    def next(self, k: int) -> list[int]:
        out = np.random.default_rng([self.seed, self.cursor]).choice(len(self.tasks), min(k, len(self.tasks)),
                                                                     replace=False).tolist()
        self.cursor += k
        return (out * (k // len(out) + 1))[:k]


# name -> class, or the import path of an optional one (extras/selectors.py)
SELECTORS = {"sequential": Sequential, "shuffle": Shuffle, "random": RandomTasks, "easy2hard": "extras.selectors.Easy2Hard",
             "diff_based": "extras.selectors.DiffBased"}
ANNOTATION_CHECK = "extras.label_studio.check_annotation"  # cfg -> None: raises for a bad annotation setting


def make_selector(name: str, kwargs: dict, tasks: list[Task], seed: int) -> Selector:
    """The selector `name` (SELECTORS, or module.Class taking (tasks, seed, **kwargs)).
    Raises ValueError (one line) for an unknown name or keyword."""
    return resolve(name, SELECTORS, "selector", kwargs)(tasks, seed, **kwargs)


# ----------------------------------------------------------------------------- experience shaping

def shape(e: Experience, op: str, bonus: float) -> None:
    """Add `bonus` to e.reward and record it: info["reward_raw"] (the reward before any
    shaping) and info["shaping"][op]."""
    e.info.setdefault("reward_raw", e.reward)
    e.info.setdefault("shaping", {})[op] = bonus
    e.reward = e.reward + bonus


class ExperiencePipeline:
    """The configured experience operators, run by trainer rank 0 on each batch it reads
    (before the batch goes to the other ranks). `__call__(groups, step) -> (groups,
    metrics)`; groups that an operator empties are dropped (counted), RuntimeError when
    none is left; metrics add pipeline/reward_raw_mean (the rewards before shaping)."""

    def __init__(self, specs: list, tokenizer=None, model: str = ""):
        self.ops = parse_ops(specs, EXPERIENCE_OPS, "experience_pipeline")
        self.tokenizer, self.model = tokenizer, model

    def __call__(self, groups: list[list[Experience]], step: int) -> tuple[list[list[Experience]], dict]:
        ctx = ExperienceContext(step, self.tokenizer, self.model)
        for name, fn, kwargs in self.ops:
            before = len(groups)
            groups = [g for g in fn(groups, ctx, **kwargs) if g]
            ctx.metrics[f"pipeline/{_label(name)}/groups_dropped"] = before - len(groups)
            if not groups:
                raise RuntimeError(f"experience_pipeline: {name} dropped every group of step {step}")
        raw = [e.info.get("reward_raw", e.reward) for g in groups for e in g]
        ctx.metrics["pipeline/reward_raw_mean"] = sum(raw) / len(raw)
        return groups, ctx.metrics


def response_text(e: Experience, tokenizer) -> str:
    """The policy's part of a response (action_mask 1 tokens), decoded."""
    resp = e.tokens[e.prompt_length:]
    return tokenizer.decode([t for t, m in zip(resp, e.action_mask) if m], skip_special_tokens=True).strip()


# ----------------------------------------------------------------------------- from the config

def check_config(cfg) -> None:
    """Raise ValueError (one line) for a mis-configured task or experience pipeline,
    selector, replay or annotation setting of config.Config `cfg`; ConnectionError when the
    Label Studio server of cfg.annotation cannot be reached (run.prepare, before any
    process starts)."""
    parse_ops(cfg.task_pipeline, TASK_OPS, "task_pipeline")
    parse_ops(cfg.experience_pipeline, EXPERIENCE_OPS, "experience_pipeline")
    selector = resolve(cfg.selector, SELECTORS, "selector", cfg.selector_kwargs)
    getattr(selector, "check_config", Selector.check_config)(cfg)  # (a selector that is no Selector subclass)
    for name, value, known in (("replay", cfg.replay, {"groups", "decay", "use_count_limit"}),
                               ("annotation", cfg.annotation, {"url", "mode", "choices", "timeout_s", "timeout_reward",
                                                               "project"})):
        if set(value) - known:
            raise ValueError(f"{name}: unknown key(s) {sorted(set(value) - known)}; known: {sorted(known)}")
    r = cfg.replay
    if r and not (isinstance(r.get("groups", 1), int) and r.get("groups", 1) >= 1 and r.get("use_count_limit", 3) >= 2
                  and r.get("decay", 2.0) >= 0):
        raise ValueError(f"replay: need groups >= 1 (an integer), use_count_limit >= 2 and decay >= 0, got {r}")
    if cfg.annotation:
        resolve(ANNOTATION_CHECK, {}, "annotation")(cfg)
