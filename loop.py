"""What the RL loop in run.py talks to on a trainer rank, one job each: `BatchReader` reads each
step's groups from the batch source (`BufferBatches`, or offline data's), `publish` hands the
weights to a publisher (sync.py: sent to the explorers, a checkpoint, none), `StepLog` writes
the step's record with the explorers' records (`ExplorerRecords`) and the rollouts' health
(`RolloutHealth`); `start_explorer` spawns mode both's explorer process, `finish` ends the run.
The composition root (components.py, run.py) builds them."""

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

import perf
import sync
from buffer import Experience
from checkpoints import delete_resume_states
from metrics import Metrics, eval_line, plot, print0
from trainer import Trainer

# warn once every advantage has been 0 for this many consecutive steps
ZERO_ADVANTAGE_WARN_STEPS = 3
# stop when the reward function failed on every rollout of this many consecutive steps
REWARD_ERROR_STEPS = 3


def check_sampling(cfg, groups: list[list[Experience]]) -> None:
    """RuntimeError (one line) for a rollout sampled at another temperature, top-p or top-k than
    cfg's: the trainer computes the current log-probs at cfg.temperature over the kept sets the
    rollout recorded, so every importance ratio would be biased (an explorer launched with other
    flags than the trainer); or for a truncated rollout without its kept sets (info
    "logprob_floors", one per response token)."""
    settings = (cfg.temperature, cfg.top_p, cfg.top_k)
    for e in (e for g in groups for e in g):
        keys = ("temperature", "top_p", "top_k")
        sampled = tuple(e.info.get(k, v) for k, v in zip(keys, settings))
        if sampled != settings:
            raise RuntimeError(
                f"experience {e.group_id} of explorer {e.explorer!r} was sampled at temperature "
                f"{sampled[0]}, top_p {sampled[1]}; this trainer computes log-probs at temperature "
                f"{cfg.temperature}, top_p {cfg.top_p}; top_k {sampled[2]} there, {cfg.top_k} "
                "here: launch both sides with the same --temperature, --top-p and --top-k"
            )
        # what the rollout itself records (offline data, recording no sampling, has no kept sets)
        truncated = e.info.get("top_p", 1.0) < 1 or e.info.get("top_k", 0) > 0
        if truncated and len(e.info.get("logprob_floors", ())) != len(e.action_mask):
            raise RuntimeError(
                f"experience {e.group_id} of explorer {e.explorer!r} was sampled at top_p "
                f"{sampled[1]}, top_k {sampled[2]} without info['logprob_floors'] per response "
                "token: its explorer's workflow records no kept sets, which training needs"
            )


class BufferBatches:
    """The batch source of online RL: each step's groups from the buffer, as the explorers wrote
    them; too stale ones dropped and replaced (max_staleness)."""

    def __init__(self, cfg, buffer):
        self.cfg = cfg
        self.buffer = buffer

    def next(self, step: int, version: int, alive: Callable[[], bool]) -> tuple[list, dict]:
        """Rank 0: the groups of `step` for weights of `version`, and their metrics; `alive` is
        polled while it waits (False: the explorer died)."""
        cfg = self.cfg
        groups = []
        dropped = 0
        while len(groups) < cfg.batch_size:
            got = self.buffer.read(
                cfg.batch_size - len(groups), cfg.buffer_timeout_s, alive, step=step
            )
            fresh = [
                g
                for g in got
                if cfg.max_staleness < 0
                or version - min(e.model_version for e in g) <= cfg.max_staleness
            ]
            dropped += len(got) - len(fresh)
            groups += fresh
        # mode both's explorer samples with this very cfg: only another launch, or the run
        # resumed, can have sampled at other settings
        if cfg.mode == "train" or cfg.resume:
            check_sampling(cfg, groups)
        return groups, {"staleness/dropped_groups": dropped}


@dataclass
class Explorers:
    """Rank 0's link to the explorers: their records so far, whether they still run, the cores
    they borrow while the trainer waits (perf.CoreShare: one CPU machine; else None), and, for
    explorers of other launches, a wait (reading records with its argument) until they left."""

    records: Callable[[], list[dict]] = list
    alive: Callable[[], bool] = lambda: True  # noqa: E731
    cores: perf.CoreShare | None = None
    wait_left: Callable[[Callable[[], None]], None] = lambda drain: None  # noqa: E731


class BatchReader:
    """Each step's groups on every trainer rank: rank 0 reads them from its batch source
    (`BufferBatches`, or offline data's) and shapes them (`shape`: --replay's groups, the
    experience pipeline, --expert-data's mixing, in that order); the other ranks get them by
    broadcast."""

    def __init__(self, rank: int, batches=None, shape: Callable | None = None):
        self.rank = rank
        self.batches = batches
        self.shape = shape
        self.explorers = Explorers()
        # rank 0's poll while it waits for a batch: False once the explorer died
        self.waiting: Callable[[], bool] = lambda: True

    def connect(self, explorers: Explorers, waiting: Callable[[], bool]) -> None:
        """Once the explorers run: their link (whose cores the trainer takes back once a batch
        is read) and the poll while waiting (ExplorerRecords.waiting)."""
        self.explorers = explorers
        self.waiting = waiting

    def read(self, step: int, version: int) -> tuple[list[list[Experience]], dict]:
        """The groups of `step` for the weights of `version`, on every rank, and rank 0's
        metrics of reading."""
        t0 = time.perf_counter()
        batch = [self.next_batch(step, version) if self.rank == 0 else None]
        dist.broadcast_object_list(batch, src=0)
        groups, m = batch[0]
        m["time/wait_s"] = time.perf_counter() - t0
        return groups, m

    def next_batch(self, step: int, version: int) -> tuple[list, dict]:
        """Rank 0: the groups of `step` from the batch source, shaped, and their metrics."""
        groups, m = self.batches.next(step, version, self.waiting)
        if self.explorers.cores is not None:
            self.explorers.cores.busy(True)
        if self.shape:
            groups, shaped = self.shape(groups, step)
            m.update(shaped)
        return groups, m


def publish(cfg, trainer: Trainer, publisher, step: int) -> dict:
    """Hand the new weights to the explorers through `publisher` (sync.SentWeights, a checkpoint
    or none); the last step also saves RUN_DIR/final. Collective. Returns the metrics of the
    publish."""
    t0 = time.perf_counter()
    digest, params = publisher.publish(trainer)
    m = {"time/sync_s": time.perf_counter() - t0}
    if digest is not None:
        m["sync/trainer_checksum"] = digest
    if step == cfg.steps - 1:
        final = params or trainer.full_parameters()
        trainer.save_final(Path(cfg.run_dir) / "final", final)
    return m


class ExplorerRecords:
    """Rank 0's reading of the explorers' records: a batch's stats wait for its step's record
    (`pending`), an evaluation is written to `metrics` and shown on `bar` at once, an error line
    is kept (`errors`), a status shows beside the bar; `meters` (perf.StepMeters) count their
    model FLOPs."""

    def __init__(self, metrics: Metrics | None, bar, group_size: int, meters: perf.StepMeters):
        self.metrics = metrics
        self.bar = bar
        self.group_size = group_size
        self.meters = meters
        self.explorers = Explorers()
        # explorer batch records by batch index, merged into that step's record
        self.pending: dict[int, dict] = {}
        self.last_eval: dict = {}
        self.errors: list[str] = []
        # when rank 0 last looked for explorer status while waiting for a batch
        self.status_at = 0.0

    def drain(self) -> None:
        """The explorers' new records."""
        for r in self.explorers.records():
            self.meters.add_explorer(r)
            if "batch" in r:
                self.pending[r["batch"]] = r
            elif "eval/accuracy" in r:
                self.metrics.write({"step": r["eval/version"], **r})
                who = f" ({r['explorer']})" if "explorer" in r else ""
                line = eval_line(r, self.group_size)
                self.bar.write(f"eval @ version {r['eval/version']}{who}: {line}")
                self.last_eval.update(r)
            elif "explorer/received_version" in r:
                self.metrics.write({"step": r["explorer/received_version"], **r})
            elif "error" in r:
                self.errors.append(r["error"])
            elif "status" in r:  # what the explorer is doing while the trainer waits for it
                self.bar.set_postfix_str(f"waiting for the explorer: {r['status']}")

    def waiting(self) -> bool:
        """Rank 0's poll while it waits for a batch: new records every 0.5 s; False once the
        explorer has died."""
        if time.perf_counter() - self.status_at > 0.5:
            self.status_at = time.perf_counter()
            self.drain()
        return self.explorers.alive()


class StepLog:
    """Rank 0's account of each step: the explorers' records (`records`), metrics.jsonl and the
    trackers (`metrics`), the progress bar, the rollouts' health; the cores go back to the
    explorer at each step's end (one CPU machine). `buffer`: its counts join each record."""

    def __init__(
        self, cfg, rank: int, world: int, start: int, buffer=None, metrics=None, meters=None
    ):
        from tqdm import tqdm

        self.rank = rank
        # in every step's record: how the cores are split
        self.placement = {
            "threads/trainer": cfg.trainer_threads,
            "threads/explorer": cfg.explorer_threads,
            "trainer/ranks": world,
        }
        self.buffer = buffer
        self.metrics = metrics
        disabled = rank != 0
        self.bar = tqdm(
            total=cfg.steps, initial=start, desc="steps", disable=disabled, dynamic_ncols=True
        )
        meters = meters or perf.StepMeters()
        self.records = ExplorerRecords(metrics, self.bar, cfg.group_size, meters)
        self.health = RolloutHealth(cfg.teacher, self.bar)
        # a service beside the run (a human annotator): its metrics, polled while waiting too
        self.extra_metrics: Callable[[], dict] = dict
        # the run's clock: the step it started at, the time the explorers ran
        self.started = (start, time.perf_counter())

    def connect(self, explorers: Explorers, extra_metrics: Callable[[], dict] = dict) -> None:
        """Once the explorers run: their link, the metrics of a service beside the run; the
        run's clock starts."""
        self.records.explorers = explorers
        self.extra_metrics = extra_metrics
        self.started = (self.started[0], time.perf_counter())

    def waiting(self) -> bool:
        """Rank 0's poll while it waits for a batch (BatchReader.waiting); False once the
        explorer has died."""
        self.extra_metrics()
        return self.records.waiting()

    def progress(self, text: str) -> None:
        """Where the step is, shown beside rank 0's progress bar."""
        self.bar.set_postfix_str(text)

    def step(self, step: int, m: dict, groups: list[list[Experience]], version: int) -> None:
        """Rank 0: complete and write the step's metrics `m` (the weights now at `version`),
        move the progress bar; on every rank, lend the cores to the explorer while the next
        batch is awaited."""
        if self.records.explorers.cores is not None:
            self.records.explorers.cores.busy(False)
        if self.rank != 0:
            return
        self.records.drain()
        m.update(self.extra_metrics())
        m.update(self.records.pending.pop(step, {}))
        m.update({f"buffer/{k}": v for k, v in self.buffer.counts().items()})
        rollouts = [g for g in groups if not g[0].info.get("offline")]
        if rollouts:
            self.health.check(step, m, rollouts)
        self.records.meters.add_step(m)
        start, t_start = self.started
        last_eval = self.records.last_eval
        m["step"] = step
        m["version"] = version
        m["time/elapsed_s"] = time.perf_counter() - t_start
        m.update(self.placement)
        m["eval/last_accuracy"] = last_eval.get("eval/accuracy")
        m.setdefault("time/sync_s", 0.0)  # a step that published nothing
        self.metrics.write(m)
        shown = {"reward": m["reward/mean"]} if "reward/mean" in m else {"loss": m["loss/policy"]}
        if last_eval:
            shown["acc"] = last_eval["eval/accuracy"]
        self.bar.set_postfix(
            {k: f"{v:.3f}" for k, v in shown.items()},
            s_per_step=f"{m['time/elapsed_s'] / (step + 1 - start):.1f}",
        )
        self.bar.update()


class RolloutHealth:
    """Staleness and zero-advantage metrics of each step's rollouts, and their warnings (on
    `bar`): every advantage 0 for ZERO_ADVANTAGE_WARN_STEPS steps (unless a `teacher` teaches
    per token), every reward failed."""

    def __init__(self, teacher: str, bar):
        self.teacher = teacher
        self.bar = bar
        # consecutive steps with every advantage 0 / with every reward errored
        self.zero_adv_steps = 0
        self.errored_steps = 0

    def check(self, step: int, m: dict, rollouts: list[list[Experience]]) -> None:
        """Add the metrics of `rollouts` to `m`, warn; RuntimeError after REWARD_ERROR_STEPS
        steps whose rewards all failed."""
        staleness = [step - e.model_version for g in rollouts for e in g]
        m["staleness/mean"] = sum(staleness) / len(staleness)
        m["staleness/max"] = max(staleness)
        # each explorer's share of the batch and staleness
        for name in sorted({g[0].explorer for g in rollouts}):
            theirs = [step - g[0].model_version for g in rollouts if g[0].explorer == name]
            m[f"explorer/{name}/share"] = len(theirs) / len(rollouts)
            m[f"explorer/{name}/staleness"] = sum(theirs) / len(theirs)
        # a teacher's per-token term teaches where every task advantage is 0
        nothing_learned = m["advantage/abs_mean"] == 0 and not self.teacher
        self.zero_adv_steps = self.zero_adv_steps + 1 if nothing_learned else 0
        errored = all("reward_error" in e.info for g in rollouts for e in g)
        self.errored_steps = self.errored_steps + 1 if errored else 0
        m["advantage/zero_steps"] = self.zero_adv_steps
        m["rollout/all_rewards_errored"] = int(errored)
        if self.zero_adv_steps == ZERO_ADVANTAGE_WARN_STEPS:
            self.bar.write(
                f"warning: every advantage has been 0 for {self.zero_adv_steps} steps: each "
                "group got equal rewards, so nothing is learned (task too easy or too hard, "
                "group_size 1, or a broken reward function)",
                file=sys.stderr,
            )
        example = next(
            (e.info["reward_error"] for g in rollouts for e in g if "reward_error" in e.info), None
        )
        if self.errored_steps >= REWARD_ERROR_STEPS:
            raise RuntimeError(
                f"the reward function failed on every rollout of {self.errored_steps} consecutive "
                f"steps, e.g. {example}"
            )
        if errored:
            self.bar.write(
                f"warning: step {step}: the reward function failed on every rollout (e.g. "
                f"{example}); see samples.log",
                file=sys.stderr,
            )


def queued(queue) -> list[dict]:
    """The records the spawned explorer has put on `queue` so far."""
    return [queue.get() for _ in iter(lambda: queue.empty(), True)]


def kept_on_resume(start: int, evals_from_buffer: bool) -> Callable[[dict], bool]:
    """On --resume from `start`: whether a record of metrics.jsonl stays, so that each is logged
    once."""

    def keep(r: dict) -> bool:
        if "eval/accuracy" in r:
            return not evals_from_buffer and r.get("eval/version", r.get("step", 0)) < start
        if "explorer/received_version" in r:
            return r["explorer/received_version"] <= start
        return r.get("step", 0) < start

    return keep


def start_explorer(
    cfg,
    model_path: str,
    version: int,
    layout,
    tasks: tuple,
    target: Callable,
    transport: type | None,
    wait_loaded: Callable | None = None,
):
    """Mode both, rank 0: spawn the explorer process running `target` (run.explorer_process);
    returns (it, its weight-sync group of class `transport` or None (checkpoints: then
    `wait_loaded(process, queue)` waits for its start weights), its Explorers link)."""
    import torch.multiprocessing as mp

    weights = weight_group(cfg, layout, 1, transport) if transport else None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # cores of one machine, one rank
    share = layout.explorer == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) == 1
    flags = ctx.Array("i", 2) if share else None
    explorer = ctx.Process(
        target=target,
        name="explorer",
        args=(
            cfg,
            model_path,
            tasks,
            weights.port if weights else None,
            queue,
            version,
            layout,
            flags,
        ),
    )
    explorer.start()
    cores = None
    if flags is not None:
        cores = perf.CoreShare(flags, 0, cfg.trainer_threads, cfg.explorer_threads)
    explorers = Explorers(lambda: queued(queue), explorer.is_alive, cores)
    if weights:
        weights.connect(explorers.alive)
    else:
        wait_loaded(explorer, queue)
    return explorer, weights, explorers


def weight_group(cfg, layout, receivers: int, transport: type = sync.WeightSync):
    """Trainer rank 0's end of the weight-sync group of `receivers` explorers (`transport`:
    sync.WeightSync, or a class with its interface)."""
    return transport(
        0,
        1 + receivers,
        port=cfg.sync_port,
        host=cfg.sync_host,
        device=layout.sync_device,
        timeout_s=cfg.sync_timeout_s,
        bucket_elems=sync.bucket_elems(cfg),
        checksum=cfg.sync_checksum,
    )


def finish(cfg, log: StepLog, version: int, explorer, weights, board: bool) -> None:
    """Rank 0 after the last step (the weights at `version`): wait for the explorer(s)
    (RuntimeError if one failed), write the final files; `board`: the run logs to TensorBoard."""
    run_dir = Path(cfg.run_dir)
    if weights:
        weights.wait(log.records.explorers.alive)
    if explorer:
        # drained while it exits: join, then drain, can deadlock
        join_draining(explorer, log.records.drain)
        if explorer.exitcode != 0:
            errors = log.records.errors
            raise RuntimeError(f"explorer failed: {errors[0] if errors else explorer.exitcode}")
    log.buffer.set_run_state("trainer_done", str(version))
    if weights and not explorer:  # mode train: the explorers see trainer_done and leave the group
        weights.wait_left(cfg.sync_timeout_s)
    # mode train: each explorer evaluates the final weights after trainer_done
    log.records.explorers.wait_left(log.records.drain)
    log.records.drain()
    (run_dir / "final" / "nanorft_config.json").write_text(
        json.dumps(dataclasses.asdict(cfg), indent=2)
    )
    if not cfg.keep_resume_state and (freed := delete_resume_states(run_dir)):
        print0(
            f"resume state deleted ({freed / 2**20:.0f} MiB), the run has finished: "
            "--keep-resume-state keeps it"
        )
    print0(f"final weights: {run_dir / 'final'}")
    if cfg.plot:
        print0(f"plot: {plot(run_dir)}")
    shown = f" (TensorBoard: tensorboard --logdir {run_dir})" if board else ""
    print0(f"metrics: {run_dir / 'metrics.jsonl'}{shown}")


def join_draining(process, drain: Callable[[], Any], timeout_s: float | None = None) -> bool:
    """Wait until `process` has exited (False after `timeout_s`), calling `drain()`: it exits once
    its queue is read."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        drain()
        process.join(0.05)
        if not process.is_alive():
            drain()
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def stop_explorer(explorer, records: ExplorerRecords) -> None:
    """The trainer failed: stop the explorer; RuntimeError with its error line if it failed
    first."""
    if explorer.is_alive():
        explorer.terminate()
        # its records are dropped: the trainer's error counts
        if not join_draining(explorer, records.explorers.records, 30):
            print(
                "run.py: warning: the explorer did not stop within 30 s of SIGTERM; killed",
                file=sys.stderr,
            )
            explorer.kill()
            explorer.join()
    else:  # the trainer noticed that the explorer failed: its reason is on the queue
        records.drain()
        if records.errors:
            raise RuntimeError(f"explorer failed: {records.errors[0]}") from None
