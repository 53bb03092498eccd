"""What the RL loop in run.py talks to on a trainer rank: `started` makes the trainer and starts
the explorer (mode both) or joins the explorers (mode train); `StepIO` reads each batch from
the buffer, publishes the weights and logs the step."""

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import launch
import perf
import sync
from buffer import Experience, open_buffer
from checkpoints import delete_resume_states, load_resume_state, resume_state
from metrics import Metrics, eval_line, print0, trackers
from perf import JobMeter
from trainer import Trainer

# warn once every advantage has been 0 for this many consecutive steps
ZERO_ADVANTAGE_WARN_STEPS = 3
# stop when the reward function failed on every rollout of this many consecutive steps
REWARD_ERROR_STEPS = 3


def read_batch(cfg, buffer, step: int, version: int, alive) -> tuple[list, dict]:
    """Rank 0: the groups of `step` (too stale: dropped, replaced; then cfg.replay's) and their metrics."""
    groups, dropped = [], 0
    while len(groups) < cfg.batch_size:
        got = buffer.read(cfg.batch_size - len(groups), cfg.buffer_timeout_s, alive, step=step)
        fresh = [
            g
            for g in got
            if cfg.max_staleness < 0
            or version - min(e.model_version for e in g) <= cfg.max_staleness
        ]
        dropped += len(got) - len(fresh)
        groups += fresh
    check_sampling(cfg, groups)
    m = {"staleness/dropped_groups": dropped}
    if cfg.replay:
        from extras.pipelines import replay

        again, eligible = replay(buffer, step, **cfg.replay)
        groups += again
        m.update(
            {
                "replay/groups": len(again),
                "replay/eligible_groups": eligible,
                "replay/use_count_mean": sum(g[0].info["use_count"] for g in again)
                / max(1, len(again)),
                "replay/priority_mean": sum(g[0].info["priority"] for g in again)
                / max(1, len(again)),
            }
        )
    return groups, m


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


def bucket_elems(cfg) -> int:
    """The weight-sync bucket in elements: --sync-bucket-mb MiB of float32; 0 = unbucketed."""
    return int(cfg.sync_bucket_mb * 2**20) // 4


@dataclass
class LoopIO:
    """What the loop talks to on rank 0 (other ranks: the defaults); send_weights None: checkpoint sync."""

    buffer: Any = None
    offline: Any = None
    expert: Any = None
    metrics: Any = None
    records: Callable[[], list[dict]] = list
    shape_experiences: Callable[[list, int], tuple[list, dict]] | None = None
    extra_metrics: Callable[[], dict] = dict
    send_weights: Callable[[int, Any], float | None] | None = None
    alive: Callable[[], bool] = lambda: True  # noqa: E731
    cores: Any = None
    trainer_meter: Any = None
    explorer_meter: Any = None


class StepIO:
    """What one trainer step reads and writes around `Trainer.step` on this rank: the batch
    (rank 0 reads it and every rank gets it), the weights to publish, the metrics and the
    progress bar. `errors`: the error lines the explorer reported."""

    def __init__(self, cfg, trainer: Trainer, start: int, io: LoopIO, rank: int, world: int):
        from tqdm import tqdm

        self.cfg = cfg
        self.trainer = trainer
        self.start = start
        self.io = io
        self.rank = rank
        self.world = world
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
        """Rank 0: the groups of `step` (the buffer's or offline data), shaped, and their metrics."""
        io = self.io
        if io.offline:
            groups, m = io.offline.draw(self.cfg.batch_size), {}
        else:
            groups, m = read_batch(self.cfg, io.buffer, step, self.trainer.version, self.waiting)
        if io.cores is not None:
            io.cores.busy(True)
        if io.shape_experiences:
            groups, shaped = io.shape_experiences(groups, step)
            m.update(shaped)
        return groups, m

    def publish(self, step: int) -> dict:
        """Send the new weights to the explorers or publish a checkpoint; the last step also
        saves RUN_DIR/final. Collective. Returns the metrics of the publish."""
        cfg, io, version = self.cfg, self.io, self.trainer.version
        t0 = time.perf_counter()
        params = digest = None
        # (run.check_modes: never with offline data)
        if cfg.sync_bucket_mb and cfg.sync_method != "checkpoint":
            buckets = self.trainer.parameter_buckets(bucket_elems(cfg))
            if self.rank == 0:
                digest = io.send_weights(version, buckets)
            for _ in buckets:  # the other ranks take part in every gather
                pass
        else:
            params = self.trainer.full_parameters()
            if self.rank == 0 and io.send_weights:
                digest = io.send_weights(version, [params])
            elif self.rank == 0 and not io.offline:
                from extras.checkpoint_sync import publish_checkpoint

                publish_checkpoint(cfg.run_dir, version, lambda d: self.trainer.save(d, params))
                digest = sync.checksum(params) if cfg.sync_checksum else None
        m = {"time/sync_s": time.perf_counter() - t0}
        if digest is not None:
            m["sync/trainer_checksum"] = digest
        if step == cfg.steps - 1:
            final = params or self.trainer.full_parameters()
            self.trainer.save_final(Path(cfg.run_dir) / "final", final)
        return m

    def waiting(self) -> bool:
        """Rank 0's poll while it waits for a batch; False once the explorer has died."""
        if time.perf_counter() - self.status_at > 0.5:
            self.status_at = time.perf_counter()
            self.drain()
        self.io.extra_metrics()
        return self.io.alive()

    def drain(self) -> None:
        """Rank 0: the explorers' new records (batch stats join their step's record)."""
        for r in self.io.records():
            if self.io.explorer_meter is not None:
                r.update(self.io.explorer_meter.measure(r))
            self.meter.add(r)
            if "batch" in r:
                self.pending[r["batch"]] = r
            elif "eval/accuracy" in r:
                self.io.metrics.write({"step": r["eval/version"], **r})
                who = f" ({r['explorer']})" if "explorer" in r else ""
                self.bar.write(
                    f"eval @ version {r['eval/version']}{who}: {eval_line(r, self.cfg.group_size)}"
                )
                self.last_eval.update(r)
            elif "explorer/received_version" in r:
                self.io.metrics.write({"step": r["explorer/received_version"], **r})
            elif "error" in r:
                self.errors.append(r["error"])
            elif "status" in r:  # what the explorer is doing while the trainer waits for it
                self.bar.set_postfix_str(f"waiting for the explorer: {r['status']}")

    def log(self, step: int, m: dict, groups: list[list[Experience]]) -> None:
        """Rank 0: complete and write the step's metrics, move the progress bar; on every rank,
        lend the cores to the explorer while the next batch is awaited."""
        if self.io.cores is not None:
            self.io.cores.busy(False)
        if self.rank != 0:
            return
        self.drain()
        m.update(self.io.extra_metrics())
        m.update(self.pending.pop(step, {}))
        m.update({f"buffer/{k}": v for k, v in self.io.buffer.counts().items()})
        rollouts = [g for g in groups if not g[0].info.get("offline")]
        if rollouts:
            self.rollout_health(step, m, rollouts)
        if self.io.trainer_meter is not None:
            m.update(self.io.trainer_meter.measure(m))
            flops = m["perf/trainer_model_flops"]
            peak = self.io.trainer_meter.peak
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
        self.io.metrics.write(m)
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
        v = [e.model_version for g in rollouts for e in g]
        m.update(
            {
                "staleness/mean": sum(step - x for x in v) / len(v),
                "staleness/max": max(step - x for x in v),
            }
        )
        # each explorer's share of the batch and staleness
        for name in sorted({g[0].explorer for g in rollouts}):
            theirs = [g for g in rollouts if g[0].explorer == name]
            m[f"explorer/{name}/share"] = len(theirs) / len(rollouts)
            m[f"explorer/{name}/staleness"] = sum(step - g[0].model_version for g in theirs) / len(
                theirs
            )
        # a teacher's per-token term teaches where every task advantage is 0
        self.zero_adv_steps = (
            self.zero_adv_steps + 1 if m["advantage/abs_mean"] == 0 and not self.cfg.teacher else 0
        )
        errored = sum("reward_error" in e.info for g in rollouts for e in g) == len(v)
        self.errored_steps = self.errored_steps + 1 if errored else 0
        m.update(
            {
                "advantage/zero_steps": self.zero_adv_steps,
                "rollout/all_rewards_errored": int(errored),
            }
        )
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


def make_trainer(cfg, model_path: str, device: torch.device) -> Trainer:
    """The Trainer of `cfg`, or for --lora-rank > 0 extras/lora.py's LoraTrainer (ValueError without peft)."""
    if not cfg.lora_rank:
        return Trainer(cfg, model_path, device)
    from extras.lora import LoraTrainer

    return LoraTrainer(cfg, model_path, device)


@contextlib.contextmanager
def started(cfg, model_path: str, rank: int, world: int, device, layout, tasks: tuple):
    """Modes both and train on this trainer rank: yields (the resumed Trainer, its StepIO, the
    first step) with the explorer (mode both, rank 0) or the explorers' group (mode train)
    running; on leaving, rank 0 waits for the explorers and writes the final files. On an
    error the explorer is stopped."""
    torch.set_num_threads(cfg.trainer_threads)
    trainer = make_trainer(cfg, model_path, device)
    state = resume_state(cfg.run_dir) if cfg.resume else None
    start = load_resume_state(trainer, state) if state else 0
    io = loop_io(cfg, trainer, start, model_path) if rank == 0 else LoopIO()
    if rank == 0:  # model FLOPs and MFU beside the RL step
        matmul = perf.matmul_params(model_path)  # the explorer samples with the same model
        passes = 3 + trainer.needs_ref  # forward and backward, and a reference model's forward
        io.trainer_meter = perf.TrainerMeter(matmul, device.type, cfg.dtype, passes)
        # mode both: the explorer's device; mode train: explorers taken to be on the trainer's kind
        explorer_device = layout.explorer if cfg.mode == "both" else device.type
        explorer_device = "cuda" if explorer_device.startswith("cuda") else "cpu"
        io.explorer_meter = perf.ExplorerMeter(matmul, explorer_device, cfg.dtype)
    explorer = weights = None
    step_io = StepIO(cfg, trainer, start, io, rank, world)
    annotating = threading.Event()
    try:
        if rank == 0 and cfg.annotation:
            from extras.label_studio import start_annotator

            io.extra_metrics = start_annotator(cfg, trainer.tokenizer, annotating)
        if rank == 0 and cfg.mode == "both":
            explorer_model = str(state / "hf") if state else model_path
            explorer, weights = start_explorer(
                cfg, io, explorer_model, trainer.version, layout, tasks
            )
        if cfg.mode == "train" and not cfg.train_data:
            from extras.train_mode import connect_explorers

            weights = connect_explorers(cfg, io, layout, trainer, rank)
        if io.cores is not None:  # (once the explorer started) threads it lends while it waits
            perf.lend_threads(trainer.model, io.cores)
        step_io.t_start = time.perf_counter()
        yield trainer, step_io, start
        step_io.bar.close()
        if rank == 0:
            finish(cfg, step_io, explorer, weights)
    except BaseException:
        step_io.bar.close()
        if explorer is not None:
            stop_explorer(explorer, step_io)
        raise
    finally:
        annotating.set()
        if io.metrics is not None:
            io.metrics.close()


def kept_on_resume(start: int, evals_from_buffer: bool) -> Callable[[dict], bool]:
    """On --resume from `start`: whether a record of metrics.jsonl stays, so that each is logged once."""

    def keep(r: dict) -> bool:
        if "eval/accuracy" in r:
            return not evals_from_buffer and r.get("eval/version", r.get("step", 0)) < start
        if "explorer/received_version" in r:
            return r["explorer/received_version"] <= start
        return r.get("step", 0) < start

    return keep


def loop_io(cfg, trainer, start: int, model_path: str):
    """Rank 0's `LoopIO` at step `start` (on --resume, experiences served after `start` go back)."""
    io = LoopIO(buffer=open_buffer(cfg.buffer, cfg.run_dir))
    if cfg.experience_pipeline:
        from extras.pipelines import ExperiencePipeline

        io.shape_experiences = ExperiencePipeline(
            cfg.experience_pipeline, trainer.tokenizer, model_path
        )
    io.buffer.set_run_state("trainer_done", None)  # a trainer is running (again)
    if cfg.resume:
        released = io.buffer.release_after(start)
        print0(
            f"resumed at step {start} (version {trainer.version}); {released} experiences served again"
        )
    evals_from_buffer = cfg.mode == "train" and not cfg.train_data
    io.metrics = Metrics(
        Path(cfg.run_dir), cfg, kept_on_resume(start, evals_from_buffer) if cfg.resume else None
    )
    if cfg.expert_fraction or cfg.train_data:
        from extras.offline import attach

        attach(cfg, io, trainer, start)
    return io


def start_explorer(cfg, io, model_path: str, version: int, layout, tasks: tuple):
    """Mode both, rank 0: spawn the explorer process, connect `io`; returns (it, sync.WeightSync or None)."""
    import torch.multiprocessing as mp

    weights = weight_group(cfg, layout, 1) if cfg.sync_method != "checkpoint" else None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # cores of one machine, one rank
    share = layout.explorer == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) == 1
    flags = ctx.Array("i", 2) if share else None
    explorer = ctx.Process(
        target=launch.run_mode_both,
        name="explorer",
        args=(
            cfg,
            model_path,
            tasks,
            weights.port if weights else 0,
            cfg.steps,
            queue,
            version,
            layout.explorer,
            layout.sync_device,
            flags,
        ),
    )
    explorer.start()
    if flags is not None:
        io.cores = perf.CoreShare(flags, 0, cfg.trainer_threads, cfg.explorer_threads)
    io.alive, io.records = explorer.is_alive, lambda: queued(queue)
    if weights:
        weights.connect(io.alive)
        io.send_weights = lambda v, buckets: weights.send(v, buckets, io.alive)
    else:
        from extras.checkpoint_sync import wait_until_loaded

        wait_until_loaded(explorer, queue)
    return explorer, weights


def weight_group(cfg, layout, receivers: int):
    """Trainer rank 0's end of the weight-sync group of `receivers` explorers."""
    return sync.transport(cfg.sync_method)(
        0,
        1 + receivers,
        port=cfg.sync_port,
        host=cfg.sync_host,
        device=layout.sync_device,
        timeout_s=cfg.sync_timeout_s,
        bucket_elems=bucket_elems(cfg),
        checksum=cfg.sync_checksum,
    )


def finish(cfg, loop, explorer, weights) -> None:
    """Rank 0 after the last step: wait for the explorer(s) (RuntimeError if one failed), write the final files."""
    run_dir = Path(cfg.run_dir)
    if weights:
        weights.wait(loop.io.alive)
    if explorer:
        join_draining(
            explorer, loop.drain
        )  # drained while it exits: join, then drain, can deadlock
        if explorer.exitcode != 0:
            raise RuntimeError(
                f"explorer failed: {loop.errors[0] if loop.errors else explorer.exitcode}"
            )
    loop.io.buffer.set_run_state("trainer_done", str(loop.trainer.version))
    if weights and not explorer:  # mode train: the explorers see trainer_done and leave the group
        from extras.train_mode import wait_left

        wait_left(weights, cfg.sync_timeout_s)
    (run_dir / "final" / "nanorft_config.json").write_text(
        json.dumps(dataclasses.asdict(cfg), indent=2)
    )
    if not cfg.keep_resume_state and (freed := delete_resume_states(run_dir)):
        print0(
            f"resume state deleted ({freed / 2**20:.0f} MiB), the run has finished: --keep-resume-state keeps it"
        )
    from extras.plot import plot

    board = (
        f" (TensorBoard: tensorboard --logdir {run_dir})" if "tensorboard" in trackers(cfg) else ""
    )
    print0(
        f"final weights: {run_dir / 'final'}\nplot: {plot(run_dir)}\nmetrics: {run_dir / 'metrics.jsonl'}{board}"
    )


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
        if not join_draining(explorer, loop.io.records, 30):
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
