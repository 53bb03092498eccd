"""Explorer: a batch's tasks (`plan_batch`), their rollouts (`rollout`, the rollout loop) and the
batch written to the buffer (`write_batch`); `evaluate` scores the held-out tasks. The
explorer's loop that calls them, paced by the sync schedule, is run.explorer_loop; the parts it
samples with (workflow, reward, selector) are `ExplorerParts`."""

import asyncio
import base64
import hashlib
import itertools
import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from buffer import Buffer, Experience, pool_for
from config import Config
from engines import Engine, Sampling, WorkflowRuns
from metrics import cpu_seconds, mean_stderr, peak_rss_gib, sampled_eval
from models import cache_dir, read_cached, write_cached
from workflows import (
    MathWorkflow,
    Selector,
    Shuffle,
    Task,
    Workflow,
    readable,
    reasoning_gym_reward,
)


@dataclass(frozen=True)
class ExplorerParts:
    """The objects the composition root picks for an explorer by the config's names (the
    defaults: a default run's).

    workflow: the class of --workflow; reward_fn: --reward-fn's function, its keyword arguments
    bound; selector: (tasks, seed) -> the Selector of --selector; curate: (explorer, buffer) ->
    (its training tasks, metrics), the task pipeline, run once before the first batch (None: the
    tasks as they are); teacher_eval: explorer -> the teacher's held-out record, reported once
    with batch 0's (None: no teacher)."""

    workflow: type[Workflow] = MathWorkflow
    reward_fn: Callable[[Task, str, Any], float | None] = reasoning_gym_reward
    selector: Callable[[list[Task], int], Selector] = Shuffle
    curate: Callable[["Explorer", Buffer], tuple[list[Task], dict]] | None = None
    teacher_eval: Callable[["Explorer"], dict] | None = None


def explorer_seed(seed: int, name: str) -> int:
    """The seed of explorer `name`: `seed` for the default explorer, distinct for the others."""
    return seed if name == Config.explorer_name else seed + zlib.crc32(name.encode())


def engine_seed(cfg) -> int:
    """The engine's sampling seed for this explorer (`explorer_seed` + 1)."""
    return explorer_seed(cfg.seed, cfg.explorer_name) + 1


@dataclass(frozen=True)
class BatchPlan:
    """A batch being generated (Explorer.plan_batch): its index, the weight version it started
    with, its start (perf_counter seconds, Explorer.work_since), the tasks retired before it
    (task_id -> pool) and the tasks drawn for it."""

    batch: int
    version: int
    t0: float
    since: tuple[int, int, float]
    retired: dict[str, str]
    tasks: list[Task]


class Explorer:
    """Rollouts of the tasks with one engine and the workflow of `parts`."""

    def __init__(
        self,
        cfg,
        engine: Engine,
        train: list[Task],
        held_out: list[Task],
        dataset,
        log,
        parts: ExplorerParts = ExplorerParts(),
    ):
        self.cfg = cfg
        self.engine = engine
        self.train = train
        self.held_out = held_out
        self.dataset = dataset  # the verifier's (reasoning-gym's), or None
        self.log = log
        self.parts = parts
        sampling = Sampling(cfg.max_tokens, cfg.temperature, cfg.top_p, cfg.top_k)
        eval_sampling = Sampling(cfg.max_tokens, cfg.eval_temperature, 1.0)
        shared = (engine.tokenizer, parts.reward_fn, dataset, cfg.system_prompt)
        self.workflow = parts.workflow(*shared, sampling, run_dir=cfg.run_dir)
        self.eval_workflow = parts.workflow(*shared, eval_sampling, run_dir=cfg.run_dir)
        self.counts = dict.fromkeys(("timeouts", "errors", "retries", "skipped"), 0)
        self.last_error = ""
        self.seed = explorer_seed(cfg.seed, cfg.explorer_name)
        # with a task pipeline: in `resume`, on the curated tasks
        self.selector = None if parts.curate else parts.selector(train, self.seed)
        self.rng = random.Random(self.seed + 1)
        self.samples = Path(cfg.run_dir) / "samples.log"
        # metrics reported with the next batch: the task pipeline's, the teacher's
        self.curation: dict = {}
        default = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.on_cpu = getattr(engine, "device", default).type == "cpu"

    def work_since(self) -> tuple[int, int, float]:
        """The engine's prefilled and sampled tokens so far and this process's CPU seconds."""
        return self.engine.prefilled_tokens, self.engine.sampled_tokens, cpu_seconds()

    def work(self, since: tuple[int, int, float], wall_s: float, prefix: str) -> dict[str, float]:
        """PREFIX_prefilled_tokens, PREFIX_sampled_tokens and PREFIX_busy_s since `since`
        (`work_since`): the CPU seconds on a CPU, else `wall_s` (perf.ExplorerMeter turns
        them into model FLOPs and MFU)."""
        prefilled, sampled, cpu_s = self.work_since()
        return {
            f"{prefix}_prefilled_tokens": prefilled - since[0],
            f"{prefix}_sampled_tokens": sampled - since[1],
            f"{prefix}_busy_s": cpu_s - since[2] if self.on_cpu else wall_s,
        }

    def resume(self, buffer: Buffer) -> int:
        """Hold this explorer's name, curate the tasks, restore its state and, at the start of a
        run with a teacher, evaluate the teacher; returns the batch to generate next."""
        cfg = self.cfg
        buffer.hold(cfg.explorer_name)
        if self.parts.curate is not None:
            self.train, self.curation = self.parts.curate(self, buffer)
            self.selector = self.parts.selector(self.train, self.seed)
        if saved := buffer.explorer_state(cfg.explorer_name):
            self.restore(saved)
        first = saved["batch"] if saved else 0
        if first == 0 and cfg.eval_size and self.parts.teacher_eval is not None:
            # the teacher's held-out accuracy, once, with batch 0's record
            self.curation.update(self.parts.teacher_eval(self))
        return first

    def next_tasks(self, k: int, retired: dict[str, str]) -> list[Task]:
        """The next k training tasks, none of the `retired` (task_id -> pool: --pool-easy,
        --pool-hard) ones except round(k * pool_lift_fraction) of them drawn back; all retired:
        all come back."""
        if not retired or len(retired) >= len(self.train):
            return [self.train[i] for i in self.selector.next(k)]
        lift = min(round(k * self.cfg.pool_lift_fraction), len(retired))
        by_id = {t.task_id: t for t in self.train} if lift else {}
        out = [by_id[i] for i in self.rng.sample(sorted(retired), lift)]
        while len(out) < k:
            task = self.train[self.selector.next(1)[0]]
            if task.task_id not in retired:
                out.append(task)
        return out

    def state(self) -> dict:
        """Resume state: the selector's, the lift sampler's and the engine's sampling RNG."""
        sampler = self.engine.rng_state()
        return {
            "selector": self.selector.state(),
            "rng": self.rng.getstate(),
            "sampler": base64.b64encode(sampler).decode() if sampler is not None else None,
        }

    def restore(self, state: dict) -> None:
        self.selector.restore(state["selector"])
        # JSON made the tuple a list
        self.rng.setstate((state["rng"][0], tuple(state["rng"][1]), state["rng"][2]))
        if state.get("sampler"):
            self.engine.set_rng_state(base64.b64decode(state["sampler"]))

    def settle(self, groups: list, outcomes: dict, attempt: int) -> bool:
        """Put each run's group (index into `groups` -> its outcome) into `groups`; a failed run
        stays None and is counted. True: none left."""
        for i, out in outcomes.items():
            if not isinstance(out, BaseException):
                groups[i] = out
                continue
            if not isinstance(out, Exception):  # cancelled: not a failure of the workflow
                raise out
            if isinstance(out, asyncio.TimeoutError):
                self.counts["timeouts"] += 1
                self.last_error = f"timeout after {self.cfg.workflow_timeout_s:.0f} s"
            else:
                self.counts["errors"] += 1
                self.last_error = f"{type(out).__name__}: {out}"
            self.counts["retries" if attempt < self.cfg.workflow_retries else "skipped"] += 1
        return all(g is not None for g in groups)

    def rollout(
        self, tasks: list[Task], workflow=None, n: int = 0
    ) -> list[list[Experience] | None]:
        """One group of `n` rollouts (default group_size) per task; None for a skipped task. The
        rollout loop: the workflows of all tasks run concurrently until each waits for
        completions, the engine generates them in one batch, and again until every run ends."""
        workflow = workflow or self.workflow
        n = n or self.cfg.group_size
        groups = [None] * len(tasks)
        engine = self.engine
        for attempt in range(self.cfg.workflow_retries + 1):
            todo = [i for i in range(len(tasks)) if groups[i] is None]
            runs = [workflow.run(tasks[i], engine, n) for i in todo]
            with WorkflowRuns(engine, runs, self.cfg.workflow_timeout_s) as waiting:
                for batch in waiting:
                    try:
                        outs = engine.generate_batch(batch.prompts, batch.ns, batch.sampling)
                    except Exception as e:  # the runs waiting on it fail, and are retried
                        outs = e
                    engine.deliver(batch, outs)
            if self.settle(groups, dict(zip(todo, waiting.outcomes)), attempt):
                break
        return groups

    def plan_batch(self, batch: int, buffer: Buffer) -> "BatchPlan":
        """Start batch `batch`: its tasks, drawn by the selector (none of the tasks `buffer`
        retired to a pool but those the pools lift), and its clock."""
        version = self.engine.version
        self.counts = dict.fromkeys(self.counts, 0)
        self.engine.working_on(f"batch {batch} (version {version})")
        retired = buffer.retired()
        tasks = self.next_tasks(self.cfg.batch_size, retired)
        return BatchPlan(batch, version, time.perf_counter(), self.work_since(), retired, tasks)

    def write_batch(
        self, plan: "BatchPlan", groups: list[list[Experience] | None], buffer: Buffer
    ) -> dict:
        """Complete batch `plan` from the rollouts of its tasks (`groups`: `rollout`'s, None for a
        skipped task) and write it to `buffer` with this explorer's state; returns its metrics
        record. A skipped task, and with --difficulty-filter a group of equal rewards, is
        replaced by the rollouts of another task, at most refill_rounds times. RuntimeError:
        the batch stays short."""
        cfg = self.cfg

        def informative(group: list[Experience]) -> bool:
            return not cfg.difficulty_filter or len({e.reward for e in group}) > 1

        generated = [g for g in groups if g]
        kept = [g for g in generated if informative(g)]
        picked = list(plan.tasks)
        rounds = 0
        while len(kept) < cfg.batch_size and rounds < cfg.refill_rounds:
            rounds += 1
            tasks = self.next_tasks(cfg.batch_size - len(kept), plan.retired)
            picked += tasks
            more = [g for g in self.rollout(tasks) if g]
            generated += more
            kept += [g for g in more if informative(g)]
        short = max(0, cfg.batch_size - len(kept))
        groups = kept[: cfg.batch_size] + [g for g in generated if not informative(g)][:short]
        if len(groups) < cfg.batch_size:
            raise RuntimeError(
                f"explorer: only {len(groups)} of {cfg.batch_size} groups after {rounds} refill "
                f"rounds ({self.counts['skipped']} tasks skipped; last error: {self.last_error})"
            )
        seconds = time.perf_counter() - plan.t0
        updates = [
            (g[0].task_id, sum(e.reward for e in g) / len(g), cfg.pool_easy, cfg.pool_hard)
            for g in generated
            if all(e.reward is not None for e in g)
        ]
        self.selector.update({task: mean for task, mean, *_ in updates})
        batch = plan.batch
        # provenance: the buffer alone tells a run's history, and the trainer checks that it
        # computes its log-probs under the distribution the tokens were sampled from
        truncated = cfg.top_p < 1 or cfg.top_k > 0
        for e in itertools.chain(*groups):
            e.explorer = cfg.explorer_name
            e.info["batch"] = batch
            e.info["temperature"] = cfg.temperature
            e.info["top_p"] = cfg.top_p
            e.info["top_k"] = cfg.top_k
            # without the kept sets the trainer's log-probs would be the full softmax's: biased
            if truncated and len(e.info.get("logprob_floors", ())) != len(e.action_mask):
                raise RuntimeError(
                    f"workflow {cfg.workflow!r} recorded no info['logprob_floors'] per response "
                    "token (workflows.floors_info), which training at --top-p < 1 or --top-k > 0 "
                    "needs: record them, or sample with --top-p 1 --top-k 0"
                )
        buffer.write_batch(groups, cfg.explorer_name, {"batch": batch + 1, **self.state()}, updates)
        self._write_samples(batch, plan.version, groups)
        exps = [e for g in generated for e in g]
        pools = [pool_for(*u[1:]) for u in updates]
        retired = len(plan.retired)
        record = self._batch_record(batch, plan.version, seconds, exps, pools, retired, picked)
        record.update(self.work(plan.since, seconds, "perf/explorer"))
        if cfg.difficulty_filter:
            record["filter/difficulty_dropped"] = len(generated) - len(kept)
            record["filter/difficulty_rounds"] = rounds
            record["filter/difficulty_short"] = short
        return record

    def _batch_record(self, batch, version, seconds, exps, pools, retired, picked) -> dict:
        """The metrics of batch `batch`: `exps` the Experiences generated, `pools` the pool of each
        task retired, `retired` the number retired before, `picked` the Tasks drawn."""
        # sampled: not a multi-turn sample's environment tokens
        gen_tokens = sum(sum(e.action_mask) for e in exps)
        record = {
            "batch": batch,
            "explorer/version": version,
            "time/explore_s": seconds,
            "explorer/gen_tokens": gen_tokens,
            "explorer/tokens_per_s": gen_tokens / seconds,
            "memory/explorer_peak_rss_gib": peak_rss_gib(),
            "rollout/reward_errors": sum("reward_error" in e.info for e in exps),
            "rollout/truncated_frac": sum(e.info["finish_reason"] == "length" for e in exps)
            / len(exps),
            "inflight/multi_version_seqs": sum(
                e.info["versions"][0] != e.info["versions"][1] for e in exps if "versions" in e.info
            ),
            "pool/retired_easy": pools.count("easy"),
            "pool/retired_hard": pools.count("hard"),
            "pool/size_retired": retired,
            "rollout/reward_pending": sum(e.reward is None for e in exps),
            **{f"rollout/{k}": v for k, v in self.counts.items()},
            **self.curation,
        }
        self.curation = {}
        if difficulties := [t.difficulty for t in picked if t.difficulty is not None]:
            record["selector/difficulty_mean"] = sum(difficulties) / len(difficulties)
        record.update(self.selector.metrics())
        record.update(episode_record(exps))
        return record

    def evaluate(self, version: int) -> dict | None:
        """The eval/* record at `version` (None without held-out tasks); version 0 is cached
        (`eval_cache`)."""
        if not self.held_out:
            return None
        cfg = self.cfg
        t0 = time.perf_counter()
        since = self.work_since()
        n = max(cfg.eval_k, cfg.group_size) if version == 0 and cfg.eval_k else cfg.eval_k
        cache = eval_cache(cfg, self.engine, self.held_out, n) if version == 0 else None
        # else another format: a miss
        if cache and (saved := read_cached(cache)).get("key") == cache.stem:
            return {**saved["record"], "eval/cached": 1, "eval/seconds": time.perf_counter() - t0}
        sampler = self.engine.rng_state()
        self.engine.working_on(f"evaluation of version {version}")
        groups = self.rollout(self.held_out, self.eval_workflow, 1)
        exps = [g[0] for g in groups if g]
        # skipped / lagged: 0
        rewards = [e.reward or 0.0 for e in exps] + [0.0] * (len(groups) - len(exps))
        record = {
            "eval/version": version,
            "eval/n": len(rewards),
            "eval/skipped": len(groups) - len(exps),
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/response_len": sum(len(e.behaviour_logprobs) for e in exps) / max(1, len(exps)),
            **format_rate(exps, "eval/format_rate"),
        }
        record.update(episode_means([e.info for e in exps], "eval/"))
        correct = [float(r == 1.0) for r in rewards]
        record["eval/accuracy"], record["eval/accuracy_stderr"] = mean_stderr(correct)
        if n:
            self.engine.working_on(f"evaluation of version {version}, {n} samples per task")
            sampled = self.rollout(self.held_out, n=n)
            # eval/learnable_groups at version 0 only
            group_size = cfg.group_size * (version == 0)
            record.update(sampled_eval(correct_counts(sampled), n, cfg.eval_k, group_size))
            sampled_exps = [e for g in sampled if g for e in g]
            record.update(format_rate(sampled_exps, "eval/sampled_format_rate"))
        if sampler is not None:
            self.engine.set_rng_state(sampler)
        if cache and not record["eval/skipped"]:
            write_cached(cache, {"key": cache.stem, "record": record})
        seconds = time.perf_counter() - t0
        return {**record, "eval/seconds": seconds, **self.work(since, seconds, "perf/eval")}

    def _write_samples(self, batch: int, version: int, groups) -> None:
        """samples.log: the prompt and two responses of each of the first log_samples groups."""

        def decode(ids: list[int]) -> str:
            return self.engine.tokenizer.decode(ids, skip_special_tokens=True).strip()

        with self.samples.open("a") as f:
            for g in groups[: self.cfg.log_samples]:
                e = g[0]
                f.write(
                    f"=== batch {batch} | version {version} | task {e.task_id} | "
                    f"answer {e.info.get('answer')}\n"
                    f"[prompt] {decode(e.tokens[: e.prompt_length])}\n"
                )
                for x in g[:2]:
                    reward = "pending" if x.reward is None else f"{x.reward:.2f}"
                    if "reward_error" in x.info:
                        reward += f" | reward error: {x.info['reward_error']}"
                    f.write(f"--- reward {reward}\n")
                    pairs = zip(x.action_mask, x.tokens[x.prompt_length :])
                    for policy, run in itertools.groupby(pairs, key=lambda p: p[0]):
                        role = "policy" if policy else "env"
                        f.write(f"[{role}] {decode([t for _, t in run])}\n")


# what a version-0 evaluation depends on, besides the weights, the held-out tasks and the engine
EVAL_SETTINGS = (
    "system_prompt reward_fn reward_kwargs workflow dtype max_tokens temperature top_p "
    "eval_temperature eval_k group_size"
).split()


def eval_cache(cfg, engine: Engine, held_out: list[Task], n: int) -> Path | None:
    """NANORFT_CACHE/evals/KEY.json, KEY a digest of engine.loaded_from's files, tasks, settings
    (None: none)."""
    if not engine.loaded_from or not (model := Path(engine.loaded_from)).is_dir():
        return None
    key = hashlib.sha256()
    for f in sorted(p for p in model.rglob("*") if p.is_file()):
        with f.open("rb") as fh:
            key.update(
                str(f.relative_to(model)).encode() + hashlib.file_digest(fh, "sha256").digest()
            )
    tasks = [[t.task_id, t.question, t.answer] for t in held_out]
    settings = [getattr(cfg, k) for k in EVAL_SETTINGS]
    described = [tasks, type(engine).__name__, str(getattr(engine, "device", "")), settings, n]
    key.update(json.dumps(described, default=str).encode())
    return cache_dir() / "evals" / f"{key.hexdigest()}.json"


def correct_counts(groups: list[list[Experience] | None]) -> list[int]:
    """Per task, its samples with reward 1 (an episode counts once; a skipped task: 0)."""
    counts = []
    for g in groups:
        correct = [e for e in g or [] if e.reward == 1.0 and not e.info.get("reflection")]
        counts.append(len({e.info.get("episode_id", id(e)) for e in correct}))
    return counts


def episode_means(infos: list[dict], prefix: str) -> dict[str, float]:
    """{prefix + NAME: mean} of the episodes' own info["metrics"] (an agent's), one sample per
    episode; {} where none has any."""
    firsts = {}
    for info in infos:
        if "metrics" in info:
            firsts.setdefault(info.get("episode_id", id(info)), info["metrics"])
    ms = list(firsts.values())
    names = dict.fromkeys(k for m in ms for k in m)
    return {prefix + k: sum(m[k] for m in ms if k in m) / sum(k in m for m in ms) for k in names}


def episode_record(exps: list[Experience]) -> dict[str, float]:
    """A batch's rollout/* metrics of its multi-turn episodes (the Experiences with an
    info["episode_id"]: samples per episode, mean turns) and the episodes' own metrics
    (`episode_means`); {} for single-turn rollouts."""
    episodes = {e.info["episode_id"]: e.info for e in exps if "episode_id" in e.info}.values()
    record = {}
    if episodes:
        samples = sum(i["samples"] for i in episodes)
        record["rollout/samples_per_episode"] = samples / len(episodes)
        record["rollout/turns_mean"] = sum(i["turns"] for i in episodes) / len(episodes)
    record.update(episode_means([e.info for e in exps], "rollout/"))
    return record


def format_rate(exps: list[Experience], key: str) -> dict[str, float]:
    """{key: the fraction of `exps` with a readable reply (`workflows.readable`)}; {} without
    replies."""
    marks = [m for m in (readable(e.info) for e in exps) if m is not None]
    return {key: sum(marks) / len(marks)} if marks else {}
