"""Explorer: rollout loop, evaluations, receiving weights (the engines: engines.py).

One entry point per mode: `run_mode_both` (the explorer process, spawned by trainer rank
0 with torch.multiprocessing) and `run_mode_explore` (a separate launch); they share
`explore_loop`. For explorer batch e it waits until its weights are
`sync.required_version(e)` (a `sync.Receiver` takes them from the trainer), runs one workflow per
task of the batch concurrently (asyncio; the engine batches their generate calls into one
forward pass), and writes each finished group to the buffer with the weight version that
produced it. Held-out accuracy is measured on the same engine every `eval_interval`
versions, with `Workflow.score`.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import multiprocessing.util
import os
import random
import signal
import sys
import time
import traceback
import zlib
from pathlib import Path

import torch

import sync
from buffer import Buffer, Experience, open_buffer, pool_for
from engines import Engine, HFEngine, Sampling, make_engine, use_gpu, vllm_available
from metrics import cpu_seconds, episode_means, mean_stderr, peak_rss_gib, sampled_eval
from perf import mfu, unit_peak
from pipelines import TaskContext, make_selector, run_task_pipeline
from workflows import Task, load_reward_fn, load_workflow, readable

DEFAULT_EXPLORER = "explorer0"


def check_config(cfg, tokenizer, dataset) -> None:
    """Resolve cfg.engine ("auto": vllm where installed, else hf) and, where the model is
    at hand (`tokenizer` of the model, rank 0; None elsewhere), create the workflow once, so that one that cannot be
    created fails here and not in the explorer process. Raises ValueError (one line)."""
    if cfg.engine == "vllm" and not vllm_available():
        raise ValueError("--engine vllm: vLLM is not installed (GPU: pip install vllm; CPU: see README)")
    if cfg.engine == "auto":
        cfg.engine = "vllm" if vllm_available() else "hf"
    if cfg.engine == "vllm" and cfg.lora_rank and cfg.inflight:
        raise ValueError("--inflight with --lora-rank needs --engine hf: a vLLM request keeps the LoRA adapter it "
                         "started with, so new adapters cannot reach sequences in flight")
    if tokenizer is None:
        return
    try:
        load_workflow(cfg.workflow)(tokenizer, load_reward_fn(cfg.reward_fn, cfg.reward_kwargs), dataset,
                                    cfg.system_prompt, Sampling(cfg.max_tokens), run_dir=cfg.run_dir)
    except Exception as e:
        raise ValueError(f"workflow {cfg.workflow!r} cannot be created: {type(e).__name__}: {e}") from None


def explorer_seed(seed: int, name: str) -> int:
    """The seed of explorer `name` (task order, lift sampling, token sampling): explorers
    with different names get different data, the same explorer the same data on every
    restart. The default explorer (mode both) keeps `seed` itself."""
    return seed if name == DEFAULT_EXPLORER else seed + zlib.crc32(name.encode())


def engine_seed(cfg) -> int:
    """The engine's sampling seed for this explorer (`explorer_seed` + 1)."""
    return explorer_seed(cfg.seed, cfg.explorer_name) + 1


class Explorer:
    """Rollout loop over a task list with one engine and one workflow class.

    cfg: config.Config (fields used: batch_size, group_size, max_tokens, temperature, top_p,
    eval_size, eval_temperature, workflow, system_prompt, seed, explorer_name).
    log: callable(dict) receiving metric records.
    """

    def __init__(self, cfg, engine: Engine, train: list[Task], held_out: list[Task], dataset, log):
        self.cfg, self.engine, self.train, self.held_out, self.log = cfg, engine, train, held_out, log
        reward_fn = load_reward_fn(cfg.reward_fn, cfg.reward_kwargs)
        make = load_workflow(cfg.workflow)
        tok = engine.tokenizer
        self.workflow = make(tok, reward_fn, dataset, cfg.system_prompt,
                             Sampling(cfg.max_tokens, cfg.temperature, cfg.top_p), run_dir=cfg.run_dir)
        self.eval_workflow = make(tok, reward_fn, dataset, cfg.system_prompt,
                                  Sampling(cfg.max_tokens, cfg.eval_temperature, 1.0), run_dir=cfg.run_dir)
        self.counts = dict.fromkeys(("timeouts", "errors", "retries", "skipped"), 0)
        self.last_error = ""
        self.seed = explorer_seed(cfg.seed, cfg.explorer_name)
        # with a task pipeline the selector is built on the curated tasks (`curate`)
        self.selector = None if cfg.task_pipeline else make_selector(cfg.selector, cfg.selector_kwargs, train, self.seed)
        self.rng = random.Random(self.seed + 1)
        self.samples = Path(cfg.run_dir) / "samples.log"
        self.curation: dict = {}  # the task pipeline's metrics, reported with the next batch
        device = getattr(engine, "device", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.on_cpu = device.type == "cpu"
        self.peak = unit_peak(device.type, cfg.dtype)  # FLOP/s of one core (CPU) or device (CUDA)

    def utilisation(self, since: tuple[float, float], wall_s: float, prefix: str) -> dict[str, float]:
        """PREFIX_model_flops (the engine's model FLOPs since `since` = (engine.model_flops,
        metrics.cpu_seconds()) was taken) and PREFIX_mfu: those FLOPs over the peak of what the
        explorer used, its CPU seconds (vLLM's engine process included) x one core's peak on a
        CPU, `wall_s` x the device's peak on CUDA."""
        flops = self.engine.model_flops - since[0]
        busy = cpu_seconds() - since[1] if self.on_cpu else wall_s
        return {f"{prefix}_model_flops": flops, f"{prefix}_mfu": mfu(flops, busy, self.peak)}

    def curate(self, buffer: Buffer) -> None:
        """Run cfg.task_pipeline (pipelines.py) on the training tasks, once per run and
        explorer: the curated list (task ids, difficulties) is kept in the buffer's run
        state, so a restarted explorer continues on the same list without scoring it again.
        Then the selector is built on it. Raises ValueError from an operator."""
        if not self.cfg.task_pipeline:
            return
        key = f"tasks/{self.cfg.explorer_name}"
        if saved := buffer.run_state(key):
            by_id = {t.task_id: t for t in self.train}
            self.train = [dataclasses.replace(by_id[i], difficulty=d) for i, d in json.loads(saved)]
        else:
            ctx = TaskContext(self.engine.tokenizer, lambda tasks, n: self._rollouts(tasks, n=n))
            before, self.train = len(self.train), run_task_pipeline(self.cfg.task_pipeline, self.train, ctx)
            buffer.set_run_state(key, json.dumps([[t.task_id, t.difficulty] for t in self.train]))
            self.curation = ctx.metrics
            print(f"explorer {self.cfg.explorer_name}: task pipeline kept {len(self.train)} of {before} tasks", flush=True)
        self.selector = make_selector(self.cfg.selector, self.cfg.selector_kwargs, self.train, self.seed)

    def next_tasks(self, k: int, retired: dict[str, str]) -> list[Task]:
        """The next k training tasks from the selector (cfg.selector: default a seeded
        shuffle, cycled), skipping retired tasks, with round(k * pool_lift_fraction) drawn
        back from the retired ones (all of them from the retired ones if every task is
        retired, so sampling never stalls)."""
        if len(retired) >= len(self.train):
            retired = {}
        lift = min(round(k * self.cfg.pool_lift_fraction), len(retired))
        by_id = {t.task_id: t for t in self.train} if lift else {}
        out = [by_id[i] for i in self.rng.sample(sorted(retired), lift)]
        if not retired:
            return out + [self.train[i] for i in self.selector.next(k - len(out))]
        while len(out) < k:
            task = self.train[self.selector.next(1)[0]]
            if task.task_id not in retired:
                out.append(task)
        return out

    def _rollouts(self, tasks: list[Task], wf=None, n: int = 0) -> list[list[Experience] | None]:
        """Run the workflow on each task concurrently: each run gets workflow_timeout_s
        seconds and workflow_retries more attempts, then it is skipped (None); timeouts,
        errors, retries and skips are counted in self.counts."""
        cfg, wf, n = self.cfg, wf or self.workflow, n or self.cfg.group_size

        async def one(task):
            for attempt in range(cfg.workflow_retries + 1):
                try:
                    return await asyncio.wait_for(wf.run(task, self.engine, n), cfg.workflow_timeout_s)
                except asyncio.TimeoutError:
                    self.counts["timeouts"] += 1
                    self.last_error = f"timeout after {cfg.workflow_timeout_s:.0f} s"
                except Exception as e:  # a crashing environment or workflow
                    self.counts["errors"] += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                if attempt < cfg.workflow_retries:
                    self.counts["retries"] += 1
            self.counts["skipped"] += 1
            return None

        async def run_all():
            return await asyncio.gather(*(one(t) for t in tasks))

        return asyncio.run(run_all())

    def state(self) -> dict:
        """Resume state: the selector's (task cursor; BOTS beliefs), the lift sampler's RNG
        and the engine's sampling RNG (HF engine; vLLM keeps its own), so a restarted
        explorer continues exactly."""
        sampler = self.engine.rng_state()
        return {"selector": self.selector.state(), "rng": self.rng.getstate(),
                "sampler": base64.b64encode(sampler).decode() if sampler is not None else None}

    def restore(self, state: dict) -> None:
        """Continue from a `state()` (saved with the last batch in the buffer)."""
        version, internal, gauss = state["rng"]
        self.selector.restore(state["selector"])
        self.rng.setstate((version, tuple(internal), gauss))
        if state.get("sampler"):
            self.engine.set_rng_state(base64.b64decode(state["sampler"]))

    def rollout_batch(self, batch: int, buffer: Buffer) -> dict:
        """Generate and store the batch_size groups of one batch (with the explorer's
        resume state, in one transaction); returns its metrics record.

        Skipped tasks (workflow timeouts / errors after retries) and, with
        cfg.difficulty_filter, groups whose rewards are all equal (no group-relative signal)
        are replaced by new tasks, for up to refill_rounds extra rounds; if still short,
        filtered groups fill the batch (counted), so the trainer always gets batch_size
        groups; a batch that cannot be filled raises RuntimeError naming the last workflow
        error. Every group with known rewards updates the task pools."""
        cfg, t0, version = self.cfg, time.perf_counter(), self.engine.version
        since = (self.engine.model_flops, cpu_seconds())
        self.counts = dict.fromkeys(self.counts, 0)
        self.engine.label = f"batch {batch} (version {version})"
        retired = buffer.retired()
        generated, kept, rounds, picked = self._fill(retired)
        informative = {id(g) for g in kept}
        dropped = [g for g in generated if id(g) not in informative]
        short = max(0, cfg.batch_size - len(kept))
        groups = kept[:cfg.batch_size] + dropped[:short]
        if len(groups) < cfg.batch_size:
            raise RuntimeError(f"explorer: only {len(groups)} of {cfg.batch_size} groups after {rounds} refill rounds "
                               f"({self.counts['skipped']} tasks skipped; last error: {self.last_error})")
        seconds = time.perf_counter() - t0
        updates = [(g[0].task_id, sum(e.reward for e in g) / len(g), cfg.pool_easy, cfg.pool_hard)
                   for g in generated if all(e.reward is not None for e in g)]
        self.selector.update({task: mean for task, mean, *_ in updates})
        for g in groups:
            for e in g:  # provenance: which explorer, in which of its batches (the buffer alone tells a run's history)
                e.explorer, e.info["batch"] = cfg.explorer_name, batch
        buffer.write_batch(groups, cfg.explorer_name, {"batch": batch + 1, **self.state()}, updates)
        self._write_samples(batch, version, groups)
        record = self._batch_record(batch, version, seconds, [e for g in generated for e in g],
                                    [pool_for(*u[1:]) for u in updates], len(retired), picked)
        record.update(self.utilisation(since, seconds, "perf/explorer"))
        if cfg.difficulty_filter:
            record.update({"filter/difficulty_dropped": len(generated) - len(kept),
                           "filter/difficulty_rounds": rounds, "filter/difficulty_short": short})
        return record

    def _fill(self, retired: set) -> tuple[list, list, int, list]:
        """Roll out batch_size new tasks, then, while fewer than batch_size groups are
        kept (skipped tasks; with cfg.difficulty_filter, groups whose rewards are all
        equal), new tasks for the missing ones, for up to cfg.refill_rounds rounds.
        Returns (every group generated, the groups kept, refill rounds, tasks picked)."""
        cfg = self.cfg
        generated, kept, rounds = [], [], 0
        tasks = picked = self.next_tasks(cfg.batch_size, retired)
        while True:
            got = [g for g in self._rollouts(tasks) if g]
            generated += got
            kept += [g for g in got if not cfg.difficulty_filter or len({e.reward for e in g}) > 1]
            if len(kept) >= cfg.batch_size or rounds >= cfg.refill_rounds:
                return generated, kept, rounds, picked
            rounds += 1
            tasks = self.next_tasks(cfg.batch_size - len(kept), retired)
            picked = picked + tasks

    def _batch_record(self, batch: int, version: int, seconds: float, exps: list[Experience], pools: list,
                      retired: int, picked: list) -> dict:
        """The metrics record of one batch: generation speed (tokens/s), rollout outcomes
        (reward errors, truncation, timeouts, retries, skips), in-flight sequences, task
        pools, curation and selector metrics, and for multi-turn workflows samples and turns
        per trajectory."""
        gen_tokens = sum(sum(e.action_mask) for e in exps)  # sampled: not a multi-turn sample's environment tokens
        record = {"batch": batch, "explorer/version": version, "time/explore_s": seconds,
                  "explorer/gen_tokens": gen_tokens, "explorer/tokens_per_s": gen_tokens / seconds,
                  "memory/explorer_peak_rss_gib": peak_rss_gib(),
                  "rollout/reward_errors": sum("reward_error" in e.info for e in exps),
                  "rollout/truncated_frac": sum(e.info["finish_reason"] == "length" for e in exps) / len(exps),
                  "inflight/multi_version_seqs": sum(e.info["versions"][0] != e.info["versions"][1] for e in exps
                                                     if "versions" in e.info),
                  "pool/retired_easy": pools.count("easy"), "pool/retired_hard": pools.count("hard"),
                  "pool/size_retired": retired, "rollout/reward_pending": sum(e.reward is None for e in exps),
                  **{f"rollout/{k}": v for k, v in self.counts.items()}, **self.curation}
        self.curation = {}
        difficulties = [t.difficulty for t in picked if t.difficulty is not None]
        if difficulties:
            record["selector/difficulty_mean"] = sum(difficulties) / len(difficulties)
        record.update(self.selector.metrics())
        trajectories = {e.info["trajectory_id"]: e.info for e in exps if "trajectory_id" in e.info}
        if trajectories:  # multi-turn
            record["rollout/samples_per_trajectory"] = sum(i["samples"] for i in trajectories.values()) / len(trajectories)
            record["rollout/turns_mean"] = sum(i["turns"] for i in trajectories.values()) / len(trajectories)
        record.update(episode_means([e.info for e in exps], "rollout/"))
        return record

    def evaluate(self, version: int) -> dict | None:
        """Held-out evaluation at `version`; None when there are no held-out tasks. Greedy
        (cfg.eval_temperature): eval/accuracy (fraction with reward 1) with
        eval/accuracy_stderr, eval/reward_mean, eval/format_rate (`workflows.readable`).
        Then cfg.eval_k samples per task at the rollouts' sampling settings (at version 0
        max(eval_k, group_size), for the base model's pass@k up to the group size):
        `metrics.sampled_eval`'s avg@k with its standard error and pass@J, and
        eval/sampled_format_rate. A skipped task counts as wrong."""
        if not self.held_out:
            return None
        cfg = self.cfg
        t0, since = time.perf_counter(), (self.engine.model_flops, cpu_seconds())
        self.engine.label = f"evaluation of version {version}"
        groups = self._rollouts(self.held_out, self.eval_workflow, 1)
        exps = [g[0] for g in groups if g]
        rewards = [e.reward or 0.0 for e in exps] + [0.0] * (len(groups) - len(exps))  # skipped / lagged: 0
        record = {"eval/version": version, "eval/n": len(rewards), "eval/skipped": len(groups) - len(exps),
                  "eval/reward_mean": sum(rewards) / len(rewards),
                  "eval/response_len": sum(len(e.behaviour_logprobs) for e in exps) / max(1, len(exps)),
                  **format_rate(exps, "eval/format_rate"), **episode_means([e.info for e in exps], "eval/")}
        record["eval/accuracy"], record["eval/accuracy_stderr"] = mean_stderr([float(r == 1.0) for r in rewards])
        if n := max(cfg.eval_k, cfg.group_size) if version == 0 and cfg.eval_k else cfg.eval_k:
            self.engine.label = f"evaluation of version {version}, {n} samples per task"
            sampled = self._rollouts(self.held_out, n=n)
            record.update(sampled_eval(correct_counts(sampled), n, cfg.eval_k),
                          **format_rate([e for g in sampled if g for e in g], "eval/sampled_format_rate"))
        return {**record, "eval/seconds": time.perf_counter() - t0,
                **self.utilisation(since, time.perf_counter() - t0, "perf/eval")}

    def bench(self, k: int) -> dict:
        """avg@k (mean reward-1 rate over k samples per held-out task) and pass@k (a task
        counts when any of its k samples has reward 1), sampling at cfg.temperature; "correct"
        lists the samples with reward 1 of each task."""
        correct = correct_counts(self._rollouts(self.held_out, n=k))
        r = sampled_eval(correct, k, k)
        return {"tasks": len(correct), "k": k, "correct": correct, f"avg@{k}": r["eval/avg_at_k"],
                f"pass@{k}": r[f"eval/pass_at_{k}"], "pass@1": r["eval/pass_at_1"]}

    def _write_samples(self, batch: int, version: int, groups) -> None:
        """samples.log: for the first log_samples groups, the prompt once and two samples,
        the response split into the policy's tokens and, in multi-turn samples, the
        environment's tokens (action_mask 0), each run marked."""
        decode = lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
        with self.samples.open("a") as f:
            for g in groups[: self.cfg.log_samples]:
                e = g[0]
                f.write(f"=== batch {batch} | version {version} | task {e.task_id} | answer {e.info.get('answer')}\n"
                        f"[prompt] {decode(e.tokens[:e.prompt_length])}\n")
                for x in g[:2]:
                    err = f" | reward error: {x.info['reward_error']}" if "reward_error" in x.info else ""
                    reward = "pending" if x.reward is None else f"{x.reward:.2f}"
                    f.write(f"--- reward {reward}{err}\n")
                    response, mask = x.tokens[x.prompt_length:], x.action_mask
                    start = 0
                    for i in range(1, len(mask) + 1):  # runs of equal action_mask
                        if i == len(mask) or mask[i] != mask[start]:
                            f.write(f"[{'policy' if mask[start] else 'env'}] {decode(response[start:i])}\n")
                            start = i


def correct_counts(groups: list[list[Experience] | None]) -> list[int]:
    """Per task, its samples with reward 1 (a multi-turn trajectory counts once; a
    reflection sample not at all; a skipped task: 0)."""
    return [len({e.info.get("trajectory_id", id(e)) for e in g or [] if e.reward == 1.0
                 and not e.info.get("reflection")}) for g in groups]


def format_rate(exps: list[Experience], key: str) -> dict[str, float]:
    """{key: the fraction of `exps` with a readable reply (`workflows.readable`)}; {} when
    no sample records its reply."""
    marks = [m for m in (readable(e.info) for e in exps) if m is not None]
    return {key: sum(marks) / len(marks)} if marks else {}


def exit_quietly(*_) -> None:
    """SIGTERM handler of the explorer process: the trainer failed, reported it and stops
    the explorer. Unwind (`finally` blocks close the engine) with exit code 1, and silence
    stderr first: wherever the signal lands (inside an asyncio task, a model forward), no
    second report reaches the user."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.exit(1)


def run_mode_both(cfg, model_path: str, tasks: tuple, port: int, total_steps: int, queue, start_version: int = 0,
                  device: str = "", sync_device: str = "cpu", core_flags=None) -> None:
    """Mode both: the explorer process, spawned by trainer rank 0 (`start_version` = the
    weights in `model_path`; `tasks` = workflows.load_tasks's triple, built by run.prepare), on `device` with its weight-sync group on `sync_device`
    (launch.place: "cpu" on CPU machines and when it shares the trainer's GPU). Before batch e it receives weights until it holds
    sync.required_version(e), over the weight-sync group (rank 1, `port`) or, with
    --sync-method checkpoint, from the checkpoints the trainer publishes; with cfg.inflight
    it also takes each publish between two decode steps, without pausing its batch. Puts
    metric records (and an error line if it fails: exit code 1) on `queue`. `core_flags`: the
    shared busy flags of sync.CoreShare (the HF engine borrows the trainer's threads while
    it waits for a batch), or None."""
    parent = os.getppid()
    alive = lambda: os.getppid() == parent  # noqa: E731 - the trainer is our parent
    by_checkpoint = cfg.sync_method == "checkpoint"

    def connect(engine) -> sync.Receiver:
        receiver = sync.Receiver(engine, cfg.run_dir, cfg.explorer_name, queue.put, alive,
                                 None if by_checkpoint else port, cfg.sync_timeout_s, sync_device, cfg.sync_host)
        if by_checkpoint:
            queue.put({"explorer/ready": True})  # its start weights are loaded: the trainer may go on
        receiver.join()
        return receiver

    def before_batch(receiver, batch):
        receiver.until(sync.required_version(batch, cfg.sync_interval, cfg.sync_offset))
        return True

    def inflight(receiver):
        if receiver.newest() > receiver.engine.version:
            receiver.receive()

    last = sync.published_versions(total_steps, cfg.sync_interval)[-1]
    signal.signal(signal.SIGTERM, exit_quietly)
    signal.signal(signal.SIGINT, exit_quietly)  # Ctrl-C: the trainer says how to resume; no second report
    try:
        queue.put({"status": f"starting the {cfg.engine} engine"})
        engine = make_engine(cfg, model_path, engine_seed(cfg), use_gpu(device), colocated=device.startswith("cuda") and sync_device == "cpu")
        engine.status = lambda text: queue.put({"status": text})
        if core_flags is not None and isinstance(engine, HFEngine):
            engine.cores = sync.CoreShare(core_flags, 1, cfg.explorer_threads, cfg.trainer_threads)
        explore_loop(cfg, engine, tasks, queue.put, total_steps, start_version, connect, before_batch, inflight,
                     lambda receiver: receiver.until(last), open_buffer(cfg.buffer, cfg.run_dir))
    except Exception as e:  # reported by the trainer as one line; the process exits with code 1
        (Path(cfg.run_dir) / f"error_{cfg.explorer_name}.log").write_text(traceback.format_exc())
        queue.put({"error": f"{type(e).__name__}: {e} (traceback: {cfg.run_dir}/error_{cfg.explorer_name}.log)"})
        queue.close()
        queue.join_thread()
        sys.exit(1)
    except SystemExit:  # SIGTERM (exit_quietly): the finally blocks have closed the engine. Run the exit
        queue.cancel_join_thread()  # handlers of multiprocessing, then leave without tearing down the weight-sync
        multiprocessing.util._exit_function()  # group: its destructor would wait for a broadcast that never comes
        os._exit(1)


def room_in_buffer(cfg, buffer: Buffer, receiver: sync.Receiver, batch: int) -> bool:
    """Mode explore, before batch `batch`: False once the trainer has finished (run state
    "trainer_done"); else wait while the buffer holds two batches of ready groups (taking
    publishes meanwhile with --sync-method broadcast: the trainer may be waiting for this
    explorer), take new weights every sync_interval batches, and return True. RuntimeError
    after buffer_timeout_s seconds without the trainer taking any group."""
    since = time.monotonic()
    while (not (done := buffer.run_state("trainer_done"))
           and buffer.counts()["ready"] >= 2 * cfg.batch_size * cfg.group_size):
        if time.monotonic() - since > cfg.buffer_timeout_s:
            raise RuntimeError(f"explorer {cfg.explorer_name}: no trainer took a batch for {cfg.buffer_timeout_s:.0f} s")
        if cfg.sync_method == "broadcast":
            receiver.catch_up()
        time.sleep(0.1)
    if done:
        return False
    if batch % cfg.sync_interval == 0:
        receiver.catch_up()
    return True


def run_mode_explore(cfg, model_path: str, tasks: tuple, log) -> None:
    """Mode explore (a separate launch, fully asynchronous): generate batches into the
    run's buffer (cfg.buffer: SQLite in the run directory, or PostgreSQL from another host)
    until the trainer has finished (run state "trainer_done" in the buffer); at the start,
    every sync_interval batches (and with cfg.inflight between decode steps) take the
    trainer's new weights: the newest checkpoint it published, or, with --sync-method
    broadcast, every publish it announced, over the weight-sync group whose store is at
    cfg.sync_host:cfg.sync_port (the explorer joins it as the next free rank; it also takes
    publishes while it waits for the trainer, which waits for every receiver; RuntimeError once the trainer's
    store stops answering while it waits for weights: sync.StoreAlive). Back-pressure: while the buffer holds two
    batches of ready groups the explorer waits (RuntimeError after buffer_timeout_s without
    the trainer taking any). Metric records go to `log` (run.py: RUN_DIR/explorer_<name>.jsonl);
    evaluation records also go to the buffer, for the trainer's metrics."""
    buffer = open_buffer(cfg.buffer, cfg.run_dir)
    by_broadcast, joined = cfg.sync_method == "broadcast", []

    def log_and_share(record: dict) -> None:
        log(record)
        if "eval/accuracy" in record:
            buffer.add_record(cfg.explorer_name, record)

    def connect(engine) -> sync.Receiver:
        # the trainer is no parent of ours: it is alive while its weight-sync store answers (waited for first:
        # it may start after us); checkpoints are never waited for (catch_up only polls)
        alive = sync.StoreAlive(cfg.sync_host, cfg.sync_port, cfg.sync_timeout_s) if by_broadcast else lambda: True
        receiver = sync.Receiver(engine, cfg.run_dir, cfg.explorer_name, log, alive=alive,
                                 port=cfg.sync_port if by_broadcast else None, timeout_s=cfg.sync_timeout_s,
                                 device="cuda" if torch.cuda.is_available() else "cpu", host=cfg.sync_host)
        joined.append(receiver)
        receiver.join()
        receiver.catch_up()
        return receiver

    # broadcast: the trainer sets trainer_done only once every receiver has its last publish
    finish = (lambda receiver: None) if by_broadcast else sync.Receiver.catch_up
    try:
        explore_loop(cfg, make_engine(cfg, model_path, engine_seed(cfg)), tasks, log_and_share, sys.maxsize, 0, connect,
                     functools.partial(room_in_buffer, cfg, buffer), sync.Receiver.catch_up, finish, buffer)
    finally:
        buffer.close()
        for receiver in joined:  # the trainer may go (its store with it) once every explorer has left
            receiver.leave()


def explore_loop(cfg, engine: Engine, tasks: tuple, log, total: int, start_version: int, connect, before_batch, inflight,
                 finish, buffer: Buffer) -> None:
    """The rollout loop of modes both and explore (it closes `engine` at the end) on `tasks`
    (workflows.load_tasks's triple): the engine holds `start_version`, `connect(engine)` -> its sync.Receiver, the explorer name
    held in `buffer` and the resume position read from it, then batches up to `total`, each
    after `before_batch(receiver, batch)` (False: stop); an evaluation every eval_interval
    versions, each after the first batch of its version (so that the trainer trains on that
    batch while the explorer evaluates), and at the end, after `finish(receiver)`; with cfg.inflight,
    `inflight(receiver)` between decode steps. Records go to `log`."""
    engine.version = start_version
    try:
        train, held_out, dataset = tasks
        receiver = connect(engine)
        explorer = Explorer(cfg, engine, train, held_out, dataset, log)
        buffer.hold(cfg.explorer_name)
        explorer.curate(buffer)
        saved = buffer.explorer_state(cfg.explorer_name)
        first = 0
        if saved:
            explorer.restore(saved)
            first = saved["batch"]
        if cfg.inflight:
            engine.step_hook = lambda: inflight(receiver)
        last_eval = None

        def maybe_eval(final: bool = False):
            nonlocal last_eval
            v = engine.version
            due = last_eval is None or v // cfg.eval_interval > last_eval // cfg.eval_interval
            if cfg.eval_size and (due or (final and last_eval != v)):
                hook, engine.step_hook = engine.step_hook, None  # evaluate one version
                if (record := explorer.evaluate(v)) is not None:
                    log(record)
                engine.step_hook = hook
                last_eval = v

        busy = engine.cores.busy if engine.cores is not None else (lambda flag: None)
        for batch in range(first, total):
            busy(False)  # waiting for weights or for the trainer: the trainer may use our cores
            if not before_batch(receiver, batch):
                break
            busy(True)
            log(explorer.rollout_batch(batch, buffer))
            maybe_eval()  # after the batch: the trainer trains on it meanwhile
        busy(False)
        engine.step_hook = None
        finish(receiver)
        maybe_eval(final=True)
    finally:
        engine.close()
