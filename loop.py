"""What the RL loop in run.py talks to on a trainer rank: `StepIO` reads each batch from its batch
source (`BufferBatches`, or offline data), hands the weights to its publisher (sync.py: sent to
the explorers, a checkpoint, none) and logs the step; `start_explorer` spawns mode both's
explorer process, `finish` ends the run. The composition root (components.py) builds them."""

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
from perf import JobMeter
from trainer import Trainer

# warn once every advantage has been 0 for this many consecutive steps
ZERO_ADVANTAGE_WARN_STEPS = 3
# stop when the reward function failed on every rollout of this many consecutive steps
REWARD_ERROR_STEPS = 3


def check_sampling(cfg, groups: list[list[Experience]]) -> None:
    """RuntimeError (one line) for a rollout sampled at another temperature or top-p than
    cfg's: the trainer computes the current log-probs at cfg.temperature, so every importance
    ratio would be biased. (An explorer launched with other flags than the trainer.)"""
    for e in (e for g in groups for e in g):
        sampled = (e.info.get("temperature", cfg.temperature), e.info.get("top_p", cfg.top_p))
        if sampled != (cfg.temperature, cfg.top_p):
            raise RuntimeError(
                f"experience {e.group_id} of explorer {e.explorer!r} was sampled at temperature "
                f"{sampled[0]}, top_p {sampled[1]}; this trainer computes log-probs at temperature "
                f"{cfg.temperature}, top_p {cfg.top_p}: launch both sides with the same "
                "--temperature and --top-p"
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
    """Rank 0's link to the explorers: their records so far, whether they still run, and the
    cores they borrow while the trainer waits (perf.CoreShare: one CPU machine; else None)."""

    records: Callable[[], list[dict]] = list
    alive: Callable[[], bool] = lambda: True  # noqa: E731
    cores: perf.CoreShare | None = None


class StepIO:
    """What one trainer step reads and writes around `Trainer.step` on this rank: the batch (rank 0
    reads it from `batches`, shaped by `shape`), the weights to publish (`connect`), the metrics
    (with the meters' FLOPs), the progress bar; `errors`: the explorer's error lines."""

    def __init__(
        self,
        cfg,
        trainer: Trainer,
        start: int,
        rank: int,
        world: int,
        buffer=None,
        metrics: Metrics | None = None,
        batches=None,
        shape: Callable[[list, int], tuple[list, dict]] | None = None,
        trainer_meter: perf.TrainerMeter | None = None,
        explorer_meter: perf.ExplorerMeter | None = None,
    ):
        from tqdm import tqdm

        self.cfg = cfg
        self.trainer = trainer
        self.start = start
        self.rank = rank
        self.world = world
        self.buffer = buffer
        self.metrics = metrics
        # the batch source: BufferBatches, or offline data's
        self.batches = batches
        # --replay's groups, the experience pipeline and --expert-data's mixing, in that order
        self.shape = shape
        # rank 0: the model FLOPs and MFU of the trainer's steps and the explorer's batches
        self.trainer_meter = trainer_meter
        self.explorer_meter = explorer_meter
        self.explorers = Explorers()
        self.publisher = None  # until `connect`
        self.extra_metrics: Callable[[], dict] = dict
        # when rank 0 last looked for explorer status while waiting for a batch
        self.status_at = 0.0
        # explorer batch records by batch index, merged into that step's record
        self.pending: dict[int, dict] = {}
        self.last_eval: dict = {}
        self.errors: list[str] = []
        # consecutive steps with every advantage 0 / with every reward errored
        self.zero_adv_steps = 0
        self.errored_steps = 0
        self.bar = tqdm(
            total=cfg.steps, initial=start, desc="steps", disable=rank != 0, dynamic_ncols=True
        )
        self.meter = JobMeter()  # cpu/utilisation_pct, perf/job_mfu
        self.t_start = time.perf_counter()
        self.t_trained = self.t_start

    def connect(
        self, explorers: Explorers, publisher, extra_metrics: Callable[[], dict] = dict
    ) -> None:
        """Once the explorers run: their link, the weight publisher, the metrics of a service
        beside the run (a human annotator's); the step's clock starts."""
        self.explorers = explorers
        self.publisher = publisher
        self.extra_metrics = extra_metrics
        self.t_start = time.perf_counter()

    def progress(self, text: str) -> None:
        """Where the step is, shown beside rank 0's progress bar."""
        self.bar.set_postfix_str(text)

    def read_batch(self, step: int) -> tuple[list[list[Experience]], dict]:
        """The groups of `step` on every rank (rank 0 reads them) and rank 0's metrics of reading."""
        t0 = time.perf_counter()
        batch = [self.next_batch(step) if self.rank == 0 else None]
        dist.broadcast_object_list(batch, src=0)
        groups, m = batch[0]
        m["time/wait_s"] = time.perf_counter() - t0
        return groups, m

    def next_batch(self, step: int) -> tuple[list, dict]:
        """Rank 0: the groups of `step` from the batch source, shaped, and their metrics."""
        groups, m = self.batches.next(step, self.trainer.version, self.waiting)
        if self.explorers.cores is not None:
            self.explorers.cores.busy(True)
        if self.shape:
            groups, shaped = self.shape(groups, step)
            m.update(shaped)
        return groups, m

    def publish(self, step: int) -> dict:
        """Hand the new weights to the explorers (the publisher: sent, a checkpoint, or none);
        the last step also saves RUN_DIR/final. Collective. Returns the metrics of the publish."""
        t0 = time.perf_counter()
        digest, params = self.publisher.publish(self.trainer)
        m = {"time/sync_s": time.perf_counter() - t0}
        if digest is not None:
            m["sync/trainer_checksum"] = digest
        if step == self.cfg.steps - 1:
            final = params or self.trainer.full_parameters()
            self.trainer.save_final(Path(self.cfg.run_dir) / "final", final)
        return m

    def waiting(self) -> bool:
        """Rank 0's poll while it waits for a batch; False once the explorer has died."""
        if time.perf_counter() - self.status_at > 0.5:
            self.status_at = time.perf_counter()
            self.drain()
        self.extra_metrics()
        return self.explorers.alive()

    def drain(self) -> None:
        """Rank 0: the explorers' new records (batch stats join their step's record)."""
        for r in self.explorers.records():
            if self.explorer_meter is not None:
                r.update(self.explorer_meter.measure(r))
            self.meter.add(r)
            if "batch" in r:
                self.pending[r["batch"]] = r
            elif "eval/accuracy" in r:
                self.metrics.write({"step": r["eval/version"], **r})
                who = f" ({r['explorer']})" if "explorer" in r else ""
                self.bar.write(
                    f"eval @ version {r['eval/version']}{who}: {eval_line(r, self.cfg.group_size)}"
                )
                self.last_eval.update(r)
            elif "explorer/received_version" in r:
                self.metrics.write({"step": r["explorer/received_version"], **r})
            elif "error" in r:
                self.errors.append(r["error"])
            elif "status" in r:  # what the explorer is doing while the trainer waits for it
                self.bar.set_postfix_str(f"waiting for the explorer: {r['status']}")

    def log(self, step: int, m: dict, groups: list[list[Experience]]) -> None:
        """Rank 0: complete and write the step's metrics, move the progress bar; on every rank,
        lend the cores to the explorer while the next batch is awaited."""
        if self.explorers.cores is not None:
            self.explorers.cores.busy(False)
        if self.rank != 0:
            return
        self.drain()
        m.update(self.extra_metrics())
        m.update(self.pending.pop(step, {}))
        m.update({f"buffer/{k}": v for k, v in self.buffer.counts().items()})
        rollouts = [g for g in groups if not g[0].info.get("offline")]
        if rollouts:
            self.rollout_health(step, m, rollouts)
        if self.trainer_meter is not None:
            m.update(self.trainer_meter.measure(m))
            flops = m["perf/trainer_model_flops"]
            peak = self.trainer_meter.peak
            m.update(self.meter.since_last(flops, peak, self.trainer.device.type))
        m.update(
            {
                "step": step,
                "version": self.trainer.version,
                "time/elapsed_s": time.perf_counter() - self.t_start,
                "threads/trainer": self.cfg.trainer_threads,
                "threads/explorer": self.cfg.explorer_threads,
                "trainer/ranks": self.world,
                "eval/last_accuracy": self.last_eval.get("eval/accuracy"),
            }
        )
        m.setdefault("time/sync_s", 0.0)  # a step that published nothing
        self.metrics.write(m)
        shown = {"reward": m["reward/mean"]} if "reward/mean" in m else {"loss": m["loss/policy"]}
        if self.last_eval:
            shown["acc"] = self.last_eval["eval/accuracy"]
        self.bar.set_postfix(
            {k: f"{v:.3f}" for k, v in shown.items()},
            s_per_step=f"{m['time/elapsed_s'] / (step + 1 - self.start):.1f}",
        )
        self.bar.update()

    def rollout_health(self, step: int, m: dict, rollouts: list[list[Experience]]) -> None:
        """Staleness and zero-advantage metrics, warnings; RuntimeError after REWARD_ERROR_STEPS
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
        nothing_learned = m["advantage/abs_mean"] == 0 and not self.cfg.teacher
        self.zero_adv_steps = self.zero_adv_steps + 1 if nothing_learned else 0
        errored = all("reward_error" in e.info for g in rollouts for e in g)
        self.errored_steps = self.errored_steps + 1 if errored else 0
        m["advantage/zero_steps"] = self.zero_adv_steps
        m["rollout/all_rewards_errored"] = int(errored)
        if self.zero_adv_steps == ZERO_ADVANTAGE_WARN_STEPS:
            self.bar.write(
                f"warning: every advantage has been 0 for {self.zero_adv_steps} steps: each group got equal "
                "rewards, so nothing is learned (task too easy or too hard, group_size 1, or a broken reward "
                "function)",
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
                f"warning: step {step}: the reward function failed on every rollout (e.g. {example}); "
                "see samples.log",
                file=sys.stderr,
            )


def queued(queue) -> list[dict]:
    """The records the spawned explorer has put on `queue` so far."""
    return [queue.get() for _ in iter(lambda: queue.empty(), True)]


def kept_on_resume(start: int, evals_from_buffer: bool) -> Callable[[dict], bool]:
    """On --resume from `start`: whether a record of metrics.jsonl stays, so that each is logged once."""

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


def finish(cfg, loop, explorer, weights, board: bool) -> None:
    """Rank 0 after the last step: wait for the explorer(s) (RuntimeError if one failed), write
    the final files; `board`: the run logs to TensorBoard."""
    run_dir = Path(cfg.run_dir)
    if weights:
        weights.wait(loop.explorers.alive)
    if explorer:
        # drained while it exits: join, then drain, can deadlock
        join_draining(explorer, loop.drain)
        if explorer.exitcode != 0:
            raise RuntimeError(
                f"explorer failed: {loop.errors[0] if loop.errors else explorer.exitcode}"
            )
    loop.buffer.set_run_state("trainer_done", str(loop.trainer.version))
    if weights and not explorer:  # mode train: the explorers see trainer_done and leave the group
        weights.wait_left(cfg.sync_timeout_s)
    (run_dir / "final" / "nanorft_config.json").write_text(
        json.dumps(dataclasses.asdict(cfg), indent=2)
    )
    if not cfg.keep_resume_state and (freed := delete_resume_states(run_dir)):
        print0(
            f"resume state deleted ({freed / 2**20:.0f} MiB), the run has finished: --keep-resume-state keeps it"
        )
    print0(f"final weights: {run_dir / 'final'}")
    if cfg.plot:
        print0(f"plot: {plot(run_dir)}")
    shown = f" (TensorBoard: tensorboard --logdir {run_dir})" if board else ""
    print0(f"metrics: {run_dir / 'metrics.jsonl'}{shown}")


def join_draining(process, drain: Callable[[], Any], timeout_s: float | None = None) -> bool:
    """Wait until `process` has exited (False after `timeout_s`), calling `drain()`: it exits once its queue is read."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        drain()
        process.join(0.05)
        if not process.is_alive():
            drain()
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def stop_explorer(explorer, loop) -> None:
    """The trainer failed: stop the explorer; RuntimeError with its error line if it failed first."""
    if explorer.is_alive():
        explorer.terminate()
        # its records are dropped: the trainer's error counts
        if not join_draining(explorer, loop.explorers.records, 30):
            print(
                "run.py: warning: the explorer did not stop within 30 s of SIGTERM; killed",
                file=sys.stderr,
            )
            explorer.kill()
            explorer.join()
    else:  # the trainer noticed that the explorer failed: its reason is on the queue
        loop.drain()
        if loop.errors:
            raise RuntimeError(f"explorer failed: {loop.errors[0]}") from None
