"""Data pipelines: task curation and selection, experience shaping, human labels.

The third pillar of Trinity-RFT (technical report, arXiv:2505.17826, section 2.3 and
examples 3.4-3.5). A module of its own because its operators run in places that belong to
no single stage: on the task list before the loop and in the choice of the next tasks (the
explorer process), between the buffer and the trainer (trainer rank 0), and beside the run,
where human labels from Label Studio become lagged rewards (`Annotator`).

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

import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from buffer import Experience
from losses import repetition_filter, resolve
from workflows import Task, ask_judge

TASK_OPS: dict[str, Callable] = {}
EXPERIENCE_OPS: dict[str, Callable] = {}


def register(registry: dict, name: str):
    """Decorator: add an operator to `registry` under `name`."""
    def add(fn):
        registry[name] = fn
        return fn
    return add


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


@register(TASK_OPS, "dedup")
def dedup(tasks: list[Task], ctx: TaskContext) -> list[Task]:
    """Keep the first of the tasks whose questions are equal after lower-casing and
    collapsing whitespace (Data-Juicer's document_deduplicator, lowercase=True)."""
    seen, out = set(), []
    for t in tasks:
        key = " ".join(t.question.lower().split())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


@register(TASK_OPS, "length_filter")
def length_filter(tasks: list[Task], ctx: TaskContext, min_tokens: int = 0, max_tokens: int = 0) -> list[Task]:
    """Keep tasks whose question has min_tokens..max_tokens tokens of the policy's
    tokenizer (max_tokens 0: no upper bound)."""
    def ok(t):
        n = len(ctx.tokenizer.encode(t.question, add_special_tokens=False))
        return n >= min_tokens and (not max_tokens or n <= max_tokens)
    return [t for t in tasks if ok(t)]


@register(TASK_OPS, "metadata_difficulty")
def metadata_difficulty(tasks: list[Task], ctx: TaskContext, keys: tuple[str, ...] = ("num_digits", "num_terms")
                        ) -> list[Task]:
    """difficulty = the sum of the task's numeric metadata fields `keys` (reasoning-gym
    entries: entry["metadata"], e.g. num_digits + num_terms of basic_arithmetic; a JSONL
    task: its own fields). Raises ValueError naming a task without one of them."""
    for t in tasks:
        meta = t.entry.get("metadata", t.entry)
        missing = [k for k in keys if not isinstance(meta.get(k), (int, float))]
        if missing:
            raise ValueError(f"metadata_difficulty: task {t.task_id} has no numeric {missing}")
        t.difficulty = float(sum(meta[k] for k in keys))
    ctx.metrics["pipeline/metadata_difficulty/mean"] = sum(t.difficulty for t in tasks) / len(tasks)
    return tasks


@register(TASK_OPS, "pass_rate_difficulty")
def pass_rate_difficulty(tasks: list[Task], ctx: TaskContext, k: int = 4) -> list[Task]:
    """difficulty = 1 - the policy's own pass rate: the mean reward of k rollouts of each
    task by the explorer's engine and workflow (Trinity-RFT report 2.3.2; BOTS uses such
    pass rates as its prior). A skipped task (workflow failure) gets difficulty 1."""
    groups = ctx.rollouts(tasks, k)
    for t, g in zip(tasks, groups):
        rewards = [e.reward for e in g or [] if e.reward is not None]
        t.difficulty = 1.0 - (sum(rewards) / len(rewards) if rewards else 0.0)
    ctx.metrics["pipeline/pass_rate_difficulty/pass_rate"] = 1 - sum(t.difficulty for t in tasks) / len(tasks)
    return tasks


@register(TASK_OPS, "model_difficulty")
def model_difficulty(tasks: list[Task], ctx: TaskContext, model: str = "", url: str = "",
                     timeout_s: float = 60.0) -> list[Task]:
    """difficulty = an auxiliary model's rating of the question from 1 (easy) to 5 (hard):
    its expected rating under P(first reply token = "1".."5") for a local model directory,
    the digit its reply starts with for an OpenAI-compatible endpoint (3 when it gives
    none) -- the judge machinery of workflows.ask_judge."""
    for t in tasks:
        msgs = [{"role": "user", "content": f"Rate how hard this problem is, from 1 (easy) to 5 (hard). "
                 f"Reply with one digit.\nProblem: {t.question}"}]
        t.difficulty = expected_rating(ask_judge(msgs, RATINGS, model, url, timeout_s))
    ctx.metrics["pipeline/model_difficulty/mean"] = sum(t.difficulty for t in tasks) / len(tasks)
    return tasks


RATINGS = ("1", "2", "3", "4", "5")


def expected_rating(p: list[float]) -> float:
    """The mean of 1..5 under probabilities `p` (normalised); 3.0 when they are all 0."""
    total = sum(p)
    return sum((i + 1) * x for i, x in enumerate(p)) / total if total else 3.0


# ----------------------------------------------------------------------------- task selection

class Selector:
    """Chooses the indices of the next training tasks (Trinity-RFT
    trinity/buffer/selector/selector.py @ 3e9eb605: get_indices / update / state_dict).
    Subclasses give `order` (a cycled order) or override `next`. `update` receives each
    group's mean reward (the task's latest pass rate) as it comes back."""

    def __init__(self, tasks: list[Task], seed: int):
        self.tasks, self.seed, self.cursor = tasks, seed, 0
        self.order = list(range(len(tasks)))

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


NEEDS_DIFFICULTY = ("selector easy2hard needs a difficulty for every task: add metadata_difficulty, "
                    "pass_rate_difficulty, model_difficulty or your own operator to task_pipeline")


class Easy2Hard(Selector):
    """Easy -> hard: the tasks sorted by ascending difficulty (ties: list order), cycled
    (Trinity-RFT's offline_easy2hard, which sorts by pass-rate features, highest first).
    Raises ValueError when a task has no difficulty (configure a *_difficulty operator)."""

    def __init__(self, tasks: list[Task], seed: int):
        super().__init__(tasks, seed)
        if any(t.difficulty is None for t in tasks):
            raise ValueError(NEEDS_DIFFICULTY)
        self.order = sorted(range(len(tasks)), key=lambda i: tasks[i].difficulty)


class DiffBased(Selector):
    """Difficulty-targeted selection (BOTS, Trinity-RFT `diff_based`: trinity/buffer/selector/
    selector.py @ 3e9eb605 DiffBasedSelector, diff_estimator.py @ 607f1dbd
    InterpolationBetaPREstimator).

    Each task i has a Beta(alpha_i, beta_i) belief over its pass rate (both start at 1).
    After a batch with observed pass rates pr_j of the selected tasks j:
        cap  <- (mean pr - mean f0_j) / (mean f1_j - mean f0_j + 1e-6)   (EMA, discount 0.9)
        p~_i  = clip((f1_i - f0_i) * cap + f0_i, 0, 1), and p~_j = pr_j
        alpha <- (1 - lamb) alpha + lamb + (1 - rho) s_bar + rho m p~
        beta  <- (1 - lamb) beta  + lamb + (1 - rho) f_bar + rho m (1 - p~)
    with s_bar_j = m pr_j, f_bar_j = m (1 - pr_j) (0 for tasks not selected). Every task
    decays and moves towards its interpolated pass rate. Anchors: f0 = 0 and f1 = the
    prior pass rate 1 - difficulty (min-max normalised over the tasks; 0.5 without
    difficulties), so p~ scales each prior by the policy's current capability.
    Selection: score = -|target - p| with p = alpha / (alpha + beta) (a Beta draw with
    do_sample); tau = 0 takes the top k, else k without replacement from softmax(score/tau).
    Defaults: the BOTS example (target 0.5, tau 0, do_sample) with the estimator's m 16,
    lamb 0.2, rho 0.2."""

    def __init__(self, tasks: list[Task], seed: int, target: float = 0.5, tau: float = 0.0, do_sample: bool = True,
                 m: int = 16, lamb: float = 0.2, rho: float = 0.2, adaptive_rho: bool = False):
        super().__init__(tasks, seed)
        self.target, self.tau, self.do_sample, self.m, self.lamb, self.rho = target, tau, do_sample, m, lamb, rho
        self.adaptive_rho = adaptive_rho
        d = np.array([0.5 if t.difficulty is None else t.difficulty for t in tasks], dtype=float)  # [n]
        span = d.max() - d.min() if len(d) else 0.0
        prior = 1 - (d - d.min()) / span if span > 0 else np.full(len(d), 0.5)                   # [n]
        self.features = np.stack([np.zeros(len(d)), prior], 1)                                   # [n, 2] (f0, f1)
        self.alphas, self.betas = np.ones(len(d)), np.ones(len(d))                               # [n]
        self.cap: float | None = None
        self.picked_pass_rate: float | None = None
        self.rng = np.random.default_rng(seed)
        self.index = {t.task_id: i for i, t in enumerate(tasks)}

    def predict(self) -> np.ndarray:
        """Pass rate per task [n]: the Beta mean, or a draw with do_sample."""
        if self.do_sample:
            return self.rng.beta(self.alphas, self.betas)
        return self.alphas / (self.alphas + self.betas)

    def next(self, k: int) -> list[int]:
        k = min(k, len(self.tasks))
        predicted = self.predict()                                                              # [n]
        scores = -np.abs(self.target - predicted)                                               # [n]
        self.cursor += k
        if self.tau == 0:
            out = np.argsort(-scores, kind="stable")[:k].tolist()
        else:
            p = np.exp((scores - scores.max()) / self.tau)
            out = self.rng.choice(len(scores), k, replace=False, p=p / p.sum()).tolist()
        self.picked_pass_rate = float(predicted[out].mean()) if out else None
        return out

    def metrics(self) -> dict:
        """selector/predicted_pass_rate: the mean predicted pass rate of the latest picks."""
        return {} if self.picked_pass_rate is None else {"selector/predicted_pass_rate": self.picked_pass_rate}

    def update(self, pass_rates: dict[str, float]) -> None:
        idx = [self.index[t] for t in pass_rates if t in self.index]
        if not idx:
            return
        pr = np.array([pass_rates[self.tasks[i].task_id] for i in idx])                         # [k]
        anchor = self.features[idx].mean(0)                                                     # [2]
        cap = (pr.mean() - anchor[0]) / (anchor[1] - anchor[0] + 1e-6)
        self.cap = cap if self.cap is None else 0.9 * self.cap + 0.1 * cap
        s_bar, f_bar = np.zeros(len(self.tasks)), np.zeros(len(self.tasks))                     # [n]
        s_bar[idx], f_bar[idx] = pr * self.m, (1 - pr) * self.m
        p_tilde = np.clip((self.features[:, 1] - self.features[:, 0]) * self.cap + self.features[:, 0], 0, 1)
        if self.adaptive_rho and np.abs(p_tilde[idx] - pr).mean() >= 0.25:
            self.rho *= 0.5
        p_tilde[idx] = pr
        self.alphas = (1 - self.lamb) * self.alphas + self.lamb + (1 - self.rho) * s_bar + self.rho * p_tilde * self.m
        self.betas = (1 - self.lamb) * self.betas + self.lamb + (1 - self.rho) * f_bar + self.rho * (1 - p_tilde) * self.m

    def state(self) -> dict:
        return {"cursor": self.cursor, "alphas": self.alphas.tolist(), "betas": self.betas.tolist(), "cap": self.cap,
                "rho": self.rho, "rng": self.rng.bit_generator.state}

    def restore(self, state: dict) -> None:
        self.cursor, self.cap, self.rho = state["cursor"], state["cap"], state["rho"]
        self.alphas, self.betas = np.array(state["alphas"]), np.array(state["betas"])
        self.rng.bit_generator.state = state["rng"]


SELECTORS = {"sequential": Sequential, "shuffle": Shuffle, "random": RandomTasks, "easy2hard": Easy2Hard,
             "diff_based": DiffBased}


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


@register(EXPERIENCE_OPS, "quality_reward")
def quality_reward(groups: list[list[Experience]], ctx: ExperienceContext, model: str = "", url: str = "",
                   weight: float = 1.0, timeout_s: float = 60.0) -> list[list[Experience]]:
    """Quality reward augmentation (Trinity-RFT report 3.4.2; Data-Juicer's
    llm_quality_score_filter rates 1-5): an auxiliary model rates each rollout's answer to
    its question from 1 to 5 (`expected_rating` of workflows.ask_judge: a local model
    directory `model` or an OpenAI-compatible endpoint `url`); the rating scaled to
    [-0.5, 0.5], (s - 3) / 4, times `weight` is added to the reward. Metrics: shaped,
    bonus_mean, rating_mean."""
    ratings = []
    for g in groups:
        question = ctx.tokenizer.decode(g[0].tokens[:g[0].prompt_length], skip_special_tokens=True)
        for e in g:
            msgs = [{"role": "user", "content": f"Rate the quality of this answer from 1 (bad) to 5 (excellent). "
                     f"Reply with one digit.\n{question}\nAnswer: {response_text(e, ctx.tokenizer)}"}]
            s = expected_rating(ask_judge(msgs, RATINGS, model, url, timeout_s))
            ratings.append(s)
            shape(e, "quality", weight * (s - 3) / 4)
    ctx.metrics.update({"pipeline/quality_reward/shaped": len(ratings),
                        "pipeline/quality_reward/rating_mean": sum(ratings) / max(1, len(ratings)),
                        "pipeline/quality_reward/bonus_mean": weight * (sum(ratings) / max(1, len(ratings)) - 3) / 4})
    return groups


_EMBEDDERS: dict = {}


def embed(texts: list[str], model: str):
    """Unit-length embeddings [N, H] (float32) of `texts`: the mean over tokens of the last
    hidden states of the local Hugging Face model directory `model` (transformers AutoModel,
    loaded once per process)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    if model not in _EMBEDDERS:
        tok = AutoTokenizer.from_pretrained(model)
        tok.pad_token = tok.pad_token or tok.eos_token
        _EMBEDDERS[model] = tok, AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    tok, lm = _EMBEDDERS[model]
    batch = tok([t or " " for t in texts], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = lm(**batch).last_hidden_state                                          # [N, T, H]
    mask = batch["attention_mask"].unsqueeze(-1).float()                                 # [N, T, 1]
    mean = (hidden * mask).sum(1) / mask.sum(1)                                           # [N, H]
    return torch.nn.functional.normalize(mean, dim=-1)


def scheduled(weight: float, final_weight: float | None, decay_steps: int, step: int) -> float:
    """`weight` moving linearly to `final_weight` over `decay_steps` steps, then constant."""
    if final_weight is None or decay_steps <= 0:
        return weight
    return weight + (final_weight - weight) * min(1.0, step / decay_steps)


@register(EXPERIENCE_OPS, "diversity_reward")
def diversity_reward(groups: list[list[Experience]], ctx: ExperienceContext, model: str = "", weight: float = 0.5,
                     final_weight: float | None = None, decay_steps: int = 0) -> list[list[Experience]]:
    """Diversity reward (Trinity-RFT report 3.4.2; Data-Juicer's group_diversity_filter):
    embed each rollout's response (`embed`, default model: the run's own), take the cosine
    similarity sim_i to its group's mean embedding, and add
        w_t * (max_j sim_j - sim_i) / (max_j sim_j - min_j sim_j)
    (0 when the group's similarities are equal; Data-Juicer's score is 0.5 times this
    ratio, here the weight scales it), so the least typical rollout gets w_t and the most
    typical 0. w_t goes linearly from `weight` to `final_weight` over
    `decay_steps` steps (e.g. 0.5 -> 0.3). Metrics: weight, similarity_mean, bonus_mean."""
    import torch

    w = scheduled(weight, final_weight, decay_steps, ctx.step)
    sims, bonuses = [], []
    for g in groups:
        emb = embed([response_text(e, ctx.tokenizer) for e in g], model or ctx.model)   # [G, H]
        sim = emb @ torch.nn.functional.normalize(emb.mean(0), dim=0)                     # [G]
        span = float(sim.max() - sim.min())
        for e, s in zip(g, sim.tolist()):
            bonus = w * (float(sim.max()) - s) / span if span > 1e-6 else 0.0
            shape(e, "diversity", bonus)
            bonuses.append(bonus)
        sims += sim.tolist()
    ctx.metrics.update({"pipeline/diversity_reward/weight": w,
                        "pipeline/diversity_reward/similarity_mean": sum(sims) / max(1, len(sims)),
                        "pipeline/diversity_reward/bonus_mean": sum(bonuses) / max(1, len(bonuses))})
    return groups


@register(EXPERIENCE_OPS, "clean")
def clean(groups: list[list[Experience]], ctx: ExperienceContext, max_tokens: int = 0, ngram: int = 0,
          max_repeat_frac: float = 0.5, dedup: bool = False) -> list[list[Experience]]:
    """Experience cleaning (Trinity-RFT report 3.4.2): drop rollouts whose response has
    more than `max_tokens` policy tokens (0: no limit), whose `ngram`-grams repeat more
    than `max_repeat_frac` (losses.repetition_filter; ngram 0: off), and with `dedup`,
    rollouts whose response text repeats an earlier one of the same group. Metrics:
    dropped_length, dropped_repetition, dropped_duplicate."""
    counts = dict.fromkeys(("length", "repetition", "duplicate"), 0)
    out = []
    for g in groups:
        kept, seen = [], set()
        for e in g:
            text = response_text(e, ctx.tokenizer) if dedup else None
            why = ("length" if max_tokens and sum(e.action_mask) > max_tokens else
                   "repetition" if ngram and not repetition_filter(e.tokens, e.logprobs, 0.0, ngram, max_repeat_frac) else
                   "duplicate" if dedup and text in seen else None)
            if why:
                counts[why] += 1
            else:
                kept.append(e)
                seen.add(text)
        out.append(kept)
    ctx.metrics.update({f"pipeline/clean/dropped_{k}": v for k, v in counts.items()})
    return out


# ----------------------------------------------------------------------------- human in the loop

RATING_CONFIG = """<View>
  <Header value="$question"/>
  <Text name="response" value="$response"/>
  <Choices name="reward" toName="response" choice="single" showInline="true">{choices}</Choices>
</View>"""
PAIR_CONFIG = """<View>
  <Header value="$question"/>
  <Text name="a" value="$a"/>
  <Text name="b" value="$b"/>
  <Choices name="preferred" toName="a" choice="single" showInline="true"><Choice value="A"/><Choice value="B"/></Choices>
</View>"""


class LabelStudio:
    """The four calls of Label Studio's REST API (https://labelstud.io/api) that the
    annotator needs, with a legacy token (`label-studio start --enable-legacy-api-token`).
    Plain HTTP rather than label-studio-sdk: the SDK (2.1) pulls in about 30 packages
    (OpenCV, NLTK, black) and pins numpy 2.2 in the training environment, for four requests.
    Raises ConnectionError (one line, token not shown) when the server cannot be reached
    or refuses a request."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}

    def call(self, method: str, path: str, body=None):
        """`method` `path` (with its query) with a JSON `body`; returns the decoded JSON reply."""
        req = urllib.request.Request(self.url + path, None if body is None else json.dumps(body).encode(),
                                     self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ConnectionError(f"Label Studio at {self.url}: {method} {path.split('?')[0]} answered {e.code} "
                                  f"{e.read()[:200].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ConnectionError(f"Label Studio at {self.url} cannot be reached: {getattr(e, 'reason', e)}") from None

    def project(self, title: str, label_config: str) -> int:
        """The id of the project titled `title`, created with `label_config` if missing."""
        found = [p for p in self.call("GET", "/api/projects?page_size=1000")["results"] if p["title"] == title]
        return found[0]["id"] if found else self.call("POST", "/api/projects",
                                                      {"title": title, "label_config": label_config})["id"]

    def import_tasks(self, project: int, data: list[dict]) -> None:
        """Add one labelling task per dict (its fields fill the label config's $names)."""
        self.call("POST", f"/api/projects/{project}/import", [{"data": d} for d in data])

    def tasks(self, project: int) -> list[dict]:
        """Every task of the project with its annotations."""
        out, page = [], 1
        while True:
            got = self.call("GET", f"/api/tasks/?project={project}&fields=all&page_size=500&page={page}")
            out += got["tasks"]
            if len(out) >= got["total"] or not got["tasks"]:
                return out
            page += 1


def check_mode(mode: str) -> None:
    """ValueError (one line) unless `mode` is an annotation mode: rating or pairwise."""
    if mode not in ("rating", "pairwise"):
        raise ValueError(f"annotation mode must be rating or pairwise, got {mode!r}")


class Annotator:
    """Human labels as lagged rewards (Trinity-RFT report 2.3.4 and 3.5; its tool is Label
    Studio, as in Data-Juicer's human_preference_annotation_mapper).

    The explorer stores rollouts with reward NULL (reward_fn "human"); each `poll()`:
      1. sends the buffer's new pending groups to the Label Studio project (mode "rating":
         one labelling task per rollout, question and response; mode "pairwise": the first
         two rollouts of the group side by side);
      2. turns finished labels into rewards: rating -> `choices[label]`; pairwise -> 1 for
         the preferred rollout and 0 for the other (the rest of the group keeps the
         timeout reward), and the pair is appended to RUN_DIR/preferences.jsonl as
         {"prompt", "chosen", "rejected"} (DPO data for --train-data);
      3. after `timeout_s` seconds a group's unlabelled rollouts get `timeout_reward`.
    The rewards of all groups completed in one poll are committed in one transaction
    (buffer.set_rewards_many); the trainer meanwhile trains on whatever groups are complete.
    `metrics`: annotation/sent, labelled, timed_out (groups, since start), waiting."""

    def __init__(self, buffer, tokenizer, url: str, token: str, run_dir: str, mode: str = "rating",
                 choices: dict | None = None, timeout_s: float = 3600.0, timeout_reward: float = 0.0,
                 project: str = ""):
        check_mode(mode)
        self.buffer, self.tokenizer, self.mode, self.run_dir = buffer, tokenizer, mode, run_dir
        self.choices = choices or {"good": 1.0, "bad": 0.0}
        self.timeout_s, self.timeout_reward = timeout_s, timeout_reward
        self.ls = LabelStudio(url, token)
        config = PAIR_CONFIG if mode == "pairwise" else RATING_CONFIG.format(
            choices="".join(f'<Choice value="{c}"/>' for c in self.choices))
        self.project = self.ls.project(project or f"nanorft {Path(run_dir).name}", config)
        self.sent = {t["data"]["group_id"]: time.time() for t in self.ls.tasks(self.project)}  # after a restart
        self.done: set[str] = set()
        self.metrics = {"annotation/sent": 0, "annotation/labelled": 0, "annotation/timed_out": 0,
                        "annotation/waiting": 0}

    def poll(self) -> dict:
        """One round of sending and collecting; returns `metrics`."""
        groups = {g[0].group_id: g for g in self.buffer.pending_group_rows()}
        new = [g for gid, g in groups.items() if gid not in self.sent]
        if new:
            self.ls.import_tasks(self.project, [d for g in new for d in self._items(g)])
            now = time.time()
            self.sent.update({g[0].group_id: now for g in new})
            self.metrics["annotation/sent"] += len(new)
        labels: dict[str, dict[int, str]] = {}
        for t in self.ls.tasks(self.project):
            done = [a for a in t["annotations"] if not a["was_cancelled"] and a["result"]]
            if done:
                labels.setdefault(t["data"]["group_id"], {})[t["data"]["index"]] = \
                    done[-1]["result"][0]["value"]["choices"][0]
        rewards, pairs, timed_out = {}, [], 0
        for gid, g in groups.items():
            got, late = labels.get(gid, {}), time.time() - self.sent.get(gid, time.time()) > self.timeout_s
            if self.mode == "rating" and (len(got) == len(g) or late):
                rewards[gid] = [self.choices.get(got[i], self.timeout_reward) if i in got else self.timeout_reward
                                for i in range(len(g))]
            elif self.mode == "pairwise" and (got or late):
                rewards[gid] = [self.timeout_reward] * len(g)
                if got:
                    win = 0 if got[0] == "A" else 1
                    rewards[gid][win], rewards[gid][1 - win] = 1.0, 0.0
                    pairs.append(self._pair(g, win))
            timed_out += gid in rewards and late and len(got) < (1 if self.mode == "pairwise" else len(g))
        if rewards:
            self.buffer.set_rewards_many(rewards)
            if pairs:
                with open(f"{self.run_dir}/preferences.jsonl", "a") as f:
                    f.writelines(json.dumps(p) + "\n" for p in pairs)
        self.metrics["annotation/labelled"] += len(rewards) - timed_out
        self.metrics["annotation/timed_out"] += timed_out
        self.metrics["annotation/waiting"] = len(groups) - len(rewards)
        return self.metrics

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _items(self, g: list[Experience]) -> list[dict]:
        q = g[0].info.get("question") or self._text(g[0].tokens[:g[0].prompt_length])
        if self.mode == "pairwise":
            return [{"question": q, "a": response_text(g[0], self.tokenizer), "b": response_text(g[1 % len(g)],
                     self.tokenizer), "group_id": g[0].group_id, "index": 0}]
        return [{"question": q, "response": response_text(e, self.tokenizer), "group_id": e.group_id, "index": i}
                for i, e in enumerate(g)]

    def _pair(self, g: list[Experience], win: int) -> dict:
        return {"prompt": g[0].info.get("question") or self._text(g[0].tokens[:g[0].prompt_length]),
                "chosen": response_text(g[win], self.tokenizer), "rejected": response_text(g[1 - win], self.tokenizer)}

    def run(self, stop: threading.Event, poll_s: float = 2.0, log: Callable[[dict], None] | None = None) -> None:
        """Poll until `stop` is set; a failed poll is reported on stderr and retried."""
        while not stop.is_set():
            try:
                m = self.poll()
                if log:
                    log(dict(m))
            except ConnectionError as e:
                print(f"annotation: {e}; retrying", file=sys.stderr, flush=True)
            stop.wait(poll_s)


# ----------------------------------------------------------------------------- from the config

def check_config(cfg) -> None:
    """Raise ValueError (one line) for a mis-configured task or experience pipeline,
    selector, replay or annotation setting of run.Config `cfg`; ConnectionError when the
    Label Studio server of cfg.annotation cannot be reached (run.prepare, before any
    process starts)."""
    parse_ops(cfg.task_pipeline, TASK_OPS, "task_pipeline")
    parse_ops(cfg.experience_pipeline, EXPERIENCE_OPS, "experience_pipeline")
    resolve(cfg.selector, SELECTORS, "selector", cfg.selector_kwargs)
    if cfg.selector == "easy2hard" and not cfg.task_pipeline:
        raise ValueError(NEEDS_DIFFICULTY)
    if cfg.selector == "diff_based" and (cfg.pool_easy <= 1 or cfg.pool_hard >= 0):
        raise ValueError("selector diff_based already targets a difficulty: leave pool_easy / pool_hard unset")
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
        check_mode(cfg.annotation.get("mode", "rating"))
        label_studio(cfg).call("GET", "/api/projects?page_size=1")


def label_studio(cfg) -> LabelStudio:
    """LabelStudio for cfg.annotation["url"] with the token in LABEL_STUDIO_API_KEY (kept out
    of the config, which is saved in the run directory); ValueError (one line) when either
    is missing."""
    token = os.environ.get("LABEL_STUDIO_API_KEY", "")
    if not cfg.annotation.get("url") or not token:
        raise ValueError("annotation needs {\"url\": \"http://HOST:PORT\"} and the Label Studio token in "
                         "LABEL_STUDIO_API_KEY (a legacy token: label-studio start --enable-legacy-api-token)")
    return LabelStudio(cfg.annotation["url"], token)


def start_annotator(cfg, tokenizer, stop: threading.Event) -> Callable[[], dict]:
    """Trainer rank 0: a daemon thread running an Annotator (cfg.annotation, its own buffer
    connection) until `stop` is set. Returns a callable giving its latest metrics (the
    loop's LoopIO.extra_metrics, also called while the trainer waits for a batch); it
    raises RuntimeError (one line naming the error) once the thread has died of any error
    (a failed poll that is not a ConnectionError, or a failed start): the rewards the
    trainer waits for would never come."""
    from buffer import open_buffer

    latest: dict = {}
    failed: list[Exception] = []
    url = label_studio(cfg).url  # ValueError without url or token
    kwargs = {k: v for k, v in cfg.annotation.items() if k != "url"}

    def work():
        try:
            buf = open_buffer(cfg.buffer, cfg.run_dir)
            try:
                Annotator(buf, tokenizer, url, os.environ["LABEL_STUDIO_API_KEY"], cfg.run_dir,
                          **kwargs).run(stop, log=latest.update)
            finally:
                buf.close()
        except Exception as e:  # any error, not only the ConnectionError that run() retries: metrics() raises it
            failed.append(e)

    def metrics() -> dict:
        if failed:
            e = failed[0]
            raise RuntimeError(f"annotator failed: {type(e).__name__}: {' '.join(str(e).split())}") from e
        return dict(latest)

    threading.Thread(target=work, name="annotator", daemon=True).start()
    return metrics
