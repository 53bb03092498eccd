"""The trainer ranks' loop of modes both and train, and the processes around it.

Every trainer rank (torchrun) runs `run_trainer`: a `TrainLoop` around a trainer.Trainer.
The loop: rank 0 reads the groups of one explorer batch from the buffer (or offline
data) and broadcasts them; every rank takes the step; the weights go to the explorer by
broadcast or as a checkpoint after the steps the sync schedule names; rank 0 writes the
metrics. On rank 0 `run_trainer` also opens what the loop talks to (`loop_io`: buffer,
pipelines, metrics, offline data), spawns the explorer process of mode both
(`start_explorer`) or waits for the `--mode explore` launches of mode train
(`connect_explorers`), and after the last step waits for them and writes the final
files and the plot (`finish`). A file of its own because it wires the trainer to the
explorer process, the buffer, the weight-sync group and the metrics: it belongs to neither
side, and run.py keeps to the config and starting the processes.
"""
from __future__ import annotations

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

import checkpoints
import sync
from buffer import Experience, open_buffer
from checkpoints import delete_resume_states, load_resume_state, resume_state, save_resume_state
from metrics import Metrics, cpu_seconds, eval_line, plot, print0, trackers
from perf import job_units, mfu
from trainer import Trainer

ZERO_ADVANTAGE_WARN_STEPS = 3  # warn once every advantage has been 0 for this many consecutive steps
ANNOTATOR = "extras.label_studio.start_annotator"  # human labels (--annotation): Label Studio, by import path
REWARD_ERROR_STEPS = 3  # stop when the reward function failed on every rollout of this many consecutive steps


def read_batch(cfg, buffer, step: int, version: int, alive) -> tuple[list, dict]:
    """Rank 0: the groups of trainer step `step` and their metrics: how many groups were
    dropped for staleness (trainer `version` - experience version > cfg.max_staleness; in
    mode train they are replaced by newer ones from the buffer, in mode both the schedule
    already bounds staleness: sync.check_config) and, with cfg.replay, the replayed groups
    added after the fresh ones (buffer.Buffer.replay)."""
    groups, dropped = [], 0
    while len(groups) < cfg.batch_size:
        got = buffer.read(cfg.batch_size - len(groups), cfg.buffer_timeout_s, alive, step=step)
        fresh = [g for g in got if cfg.max_staleness < 0
                 or version - min(e.model_version for e in g) <= cfg.max_staleness]
        dropped += len(got) - len(fresh)
        groups += fresh
    m = {"staleness/dropped_groups": dropped}
    if cfg.replay:
        from losses import resolve

        replay = resolve("extras.pipelines.replay", {}, "replay")
        again, eligible = replay(buffer, step=step, **{"groups": 1, **cfg.replay})
        groups += again
        m.update({"replay/groups": len(again), "replay/eligible_groups": eligible,
                  "replay/use_count_mean": sum(g[0].info["use_count"] for g in again) / max(1, len(again)),
                  "replay/priority_mean": sum(g[0].info["priority"] for g in again) / max(1, len(again))})
    return groups, m


def explorer_shares(groups: list, version: int) -> dict[str, float]:
    """Per explorer name: its share of the batch's groups and its mean staleness (steps)."""
    out: dict[str, float] = {}
    names = [g[0].explorer for g in groups]
    for name in sorted(set(names)):
        mine = [g for g, n in zip(groups, names) if n == name]
        out[f"explorer/{name}/share"] = len(mine) / len(groups)
        out[f"explorer/{name}/staleness"] = sum(version - g[0].model_version for g in mine) / len(mine)
    return out


def bucket_elems(cfg) -> int:
    """The weight-sync bucket in elements: --sync-bucket-mb MiB of float32 (the trainer's
    gathered parameters; on a bf16 wire a bucket takes half that); 0 = unbucketed."""
    return int(cfg.sync_bucket_mb * 2 ** 20) // 4


@dataclass
class LoopIO:
    """What the loop talks to on rank 0 (the other ranks get the defaults). buffer: the
    run's buffer.Buffer; offline / expert: workflows.OfflineSampler of offline (SFT, DPO)
    and expert (MIX) data, or None; metrics: an object with write(record) (metrics.Metrics);
    records(): the explorers' new records (batch stats, evaluations, weight receipts,
    errors); shape(groups, step) -> (groups, metrics): the experience pipeline
    (pipelines.ExperiencePipeline) or None; extra_metrics(): more metrics for each step
    (the annotator's), also called at every poll while waiting for a batch: it raises
    RuntimeError once what produces them has failed; send_weights(version, buckets) ->
    checksum: the broadcast to the explorers
    (sync.WeightSync.send), or None: weights are published as checkpoints in the run dir
    (not with offline data);
    alive(): False once the explorer this loop waits for has died; cores: the sync.CoreShare
    of a one-rank trainer and its CPU explorer (threads lent while one side waits), or None."""

    buffer: Any = None
    offline: Any = None
    expert: Any = None
    metrics: Any = None
    records: Callable[[], list[dict]] = list
    shape: Callable[[list, int], tuple[list, dict]] | None = None
    extra_metrics: Callable[[], dict] = dict
    send_weights: Callable[[int, Any], float] | None = None
    alive: Callable[[], bool] = lambda: True  # noqa: E731
    cores: Any = None


class TrainLoop:
    """The trainer ranks' loop of modes both and train. Every step: rank 0 reads a batch
    (`read_batch`, or offline data; MIX adds expert sequences) and broadcasts it; every
    rank runs `Trainer.step`; after the steps the schedule names (sync.publishes_after)
    the weights go to the explorer (`io.send_weights`) or into a checkpoint, and the final
    step saves RUN_DIR/final; the resume state is saved every checkpoint_interval steps;
    rank 0 writes the step's metrics with the explorer's records of that batch.
    `errors`: error lines the explorer reported."""

    def __init__(self, cfg, trainer: Trainer, start: int, io: LoopIO, rank: int, world: int):
        from tqdm import tqdm

        self.cfg, self.trainer, self.start, self.io, self.rank, self.world = cfg, trainer, start, io, rank, world
        trainer.progress = lambda text: self.bar.set_postfix_str(text)
        self.status_at = 0.0  # when rank 0 last looked for explorer status while waiting for a batch
        self.pending: dict[int, dict] = {}  # explorer batch records by batch index, merged into that step
        self.last_eval: dict = {}
        self.errors: list[str] = []
        self.zero_adv_steps = self.errored_steps = 0  # consecutive steps with every advantage 0 / every reward errored
        self.bar = tqdm(total=cfg.steps, initial=start, desc="steps", disable=rank != 0, dynamic_ncols=True)
        self.cpu_mark = (cpu_seconds(), time.perf_counter())  # for cpu/utilisation_pct between two steps
        self.explorer_flops = 0.0  # the explorers' model FLOPs (batches and evaluations) reported since the last step

    def run(self) -> None:
        """Steps start .. cfg.steps - 1. Raises RuntimeError when the reward function failed on
        every rollout of REWARD_ERROR_STEPS steps in a row."""
        self.trainer.cores = self.io.cores  # (mode both: set once the explorer has started)
        try:
            self.t_start = time.perf_counter()
            for step in range(self.start, self.cfg.steps):
                self.step(step)
        finally:
            self.bar.close()

    def step(self, step: int) -> None:
        cfg, io, t0 = self.cfg, self.io, time.perf_counter()
        groups, read_m = [None], {}
        if self.rank == 0:
            if io.offline:
                groups = [io.offline.draw(cfg.batch_size)]
            else:
                groups[0], read_m = read_batch(cfg, io.buffer, step, self.trainer.version, self.waiting)
            if io.cores is not None:
                io.cores.busy(True)
            if io.shape:
                groups[0], shaped = io.shape(groups[0], step)
                read_m.update(shaped)
            if io.expert:  # MIX: this fraction of the batch's sequences is expert data
                n = sum(map(len, groups[0]))
                groups[0] += io.expert.draw(max(1, round(cfg.expert_fraction * n / (1 - cfg.expert_fraction))))
                # n varies (shaping, replay, multi-turn groups): the resume state records how far the sampler is
                self.trainer.loop_state["expert_drawn"] = io.expert.drawn
        dist.broadcast_object_list(groups, src=0)
        wait_s = time.perf_counter() - t0
        m = self.trainer.step(groups[0])
        t1 = time.perf_counter()
        if sync.publishes_after(step, cfg.sync_interval, cfg.steps):
            self.publish(step, m)
        if cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0 and step < cfg.steps - 1:
            save_resume_state(self.trainer, cfg.run_dir, step + 1)
        if io.cores is not None:
            io.cores.busy(False)  # waiting for the next batch: the explorer may use our cores
        if self.rank == 0:
            m.update({"time/wait_s": wait_s, "time/sync_s": time.perf_counter() - t1, **read_m, **io.extra_metrics()})
            self.log(step, m, [g for g in groups[0] if not g[0].info.get("offline")])

    def publish(self, step: int, m: dict) -> None:
        """Send the new weights to the explorers or publish them as a checkpoint (rank 0;
        every rank gathers them); the last step also saves RUN_DIR/final. With
        --sync-bucket-mb and broadcast sync, every rank gathers one bucket at a time while
        rank 0 sends it (sync.WeightSync.send)."""
        cfg, io, version = self.cfg, self.io, self.trainer.version
        params = None
        if cfg.sync_bucket_mb and cfg.sync_method == "broadcast":  # (run.check_modes: never with offline data)
            buckets = self.trainer.parameter_buckets(bucket_elems(cfg))
            if self.rank == 0:
                m["sync/trainer_checksum"] = io.send_weights(version, buckets)
            for _ in buckets:  # the other ranks take part in every gather
                pass
        else:
            params = self.trainer.full_parameters()
            if self.rank == 0 and io.send_weights:
                m["sync/trainer_checksum"] = io.send_weights(version, [params])
            elif self.rank == 0 and not io.offline:
                checkpoints.publish_checkpoint(Path(cfg.run_dir), version, lambda d: self.trainer.save(d, params))
                m["sync/trainer_checksum"] = sync.checksum(params)
        if step == cfg.steps - 1:
            params = params if params is not None else self.trainer.full_parameters()
            self.trainer.save_final(Path(cfg.run_dir) / "final", params)

    def waiting(self) -> bool:
        """Rank 0's poll while it waits for a batch: show the explorer's status lines (twice
        a second at most); False once the explorer has died (io.alive). Raises what
        io.extra_metrics raises (RuntimeError: the annotator, whose rewards the batch waits
        for, has failed)."""
        if time.perf_counter() - self.status_at > 0.5:
            self.status_at = time.perf_counter()
            self.drain()
        self.io.extra_metrics()
        return self.io.alive()

    def drain(self) -> None:
        """Rank 0: the explorers' new records. Batch stats join their step's record;
        evaluations and weight receipts are written as records of their own, at step =
        their weight version; errors are kept in `errors`."""
        for r in self.io.records():
            self.explorer_flops += r.get("perf/explorer_model_flops", 0.0) + r.get("perf/eval_model_flops", 0.0)
            if "batch" in r:
                self.pending[r["batch"]] = r
            elif "eval/accuracy" in r:
                self.io.metrics.write({"step": r["eval/version"], **r})
                who = f" ({r['explorer']})" if "explorer" in r else ""
                self.bar.write(f"eval @ version {r['eval/version']}{who}: {eval_line(r)}")
                self.last_eval.update(r)
            elif "explorer/received_version" in r:
                self.io.metrics.write({"step": r["explorer/received_version"], **r})
            elif "error" in r:
                self.errors.append(r["error"])
            elif "status" in r:  # what the explorer is doing while the trainer waits for it
                self.bar.set_postfix_str(f"waiting for the explorer: {r['status']}")

    def log(self, step: int, m: dict, rollouts: list[list[Experience]]) -> None:
        """Rank 0: complete the step's metrics (the explorer's batch record, buffer counts,
        staleness, shares), warn about steps that cannot learn, write the record and move
        the progress bar."""
        cfg = self.cfg
        self.drain()
        m.update(self.pending.pop(step, {}))
        m.update({f"buffer/{k}": v for k, v in self.io.buffer.counts().items()})
        if rollouts:
            self.check_learning(step, m, rollouts)
        cpu_s, now = cpu_seconds(), time.perf_counter()
        m["cpu/utilisation_pct"] = 100 * (cpu_s - self.cpu_mark[0]) / max(1e-9, now - self.cpu_mark[1])
        job_peak = self.trainer.peak * job_units(self.trainer.device.type)  # every core (CPU) or GPU of the machine
        m["perf/job_mfu"] = mfu(m.get("perf/trainer_model_flops", 0.0) + self.explorer_flops, now - self.cpu_mark[1],
                                job_peak)
        self.cpu_mark, self.explorer_flops = (cpu_s, now), 0.0
        m.update({"step": step, "version": self.trainer.version, "time/elapsed_s": time.perf_counter() - self.t_start,
                  "threads/trainer": cfg.trainer_threads, "threads/explorer": cfg.explorer_threads,
                  "trainer/ranks": self.world, "eval/last_accuracy": self.last_eval.get("eval/accuracy")})
        self.io.metrics.write(m)
        shown = {"reward": m["reward/mean"]} if "reward/mean" in m else {"loss": m["loss/policy"]}
        if self.last_eval:
            shown["acc"] = self.last_eval["eval/accuracy"]
        self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items()},
                             s_per_step=f"{m['time/elapsed_s'] / (step + 1 - self.start):.1f}")
        self.bar.update()

    def check_learning(self, step: int, m: dict, rollouts: list[list[Experience]]) -> None:
        """Staleness and share metrics of the batch's rollouts; a warning once every advantage
        has been 0 for ZERO_ADVANTAGE_WARN_STEPS steps, one per step whose rewards all failed,
        and RuntimeError after REWARD_ERROR_STEPS such steps in a row."""
        v = [e.model_version for g in rollouts for e in g]
        m.update({"staleness/mean": sum(step - x for x in v) / len(v), "staleness/max": max(step - x for x in v),
                  **explorer_shares(rollouts, step)})
        self.zero_adv_steps = self.zero_adv_steps + 1 if m["advantage/abs_mean"] == 0 else 0
        errored = sum("reward_error" in e.info for g in rollouts for e in g) == len(v)
        self.errored_steps = self.errored_steps + 1 if errored else 0
        m.update({"advantage/zero_steps": self.zero_adv_steps, "rollout/all_rewards_errored": int(errored)})
        if self.zero_adv_steps == ZERO_ADVANTAGE_WARN_STEPS:
            self.bar.write(f"warning: every advantage has been 0 for {self.zero_adv_steps} steps: each group got equal "
                           "rewards, so nothing is learned (task too easy or too hard, group_size 1, or a broken reward "
                           "function)", file=sys.stderr)
        example = next((e.info["reward_error"] for g in rollouts for e in g if "reward_error" in e.info), None)
        if self.errored_steps >= REWARD_ERROR_STEPS:
            raise RuntimeError(f"the reward function failed on every rollout of {self.errored_steps} consecutive "
                               f"steps, e.g. {example}")
        if errored:
            self.bar.write(f"warning: step {step}: the reward function failed on every rollout (e.g. {example}); "
                           "see samples.log", file=sys.stderr)


# ----------------------------------------------------------------------------- processes

def wait_until_loaded(explorer, queue) -> None:
    """Mode both, checkpoint sync: block until the spawned explorer reports its start weights
    loaded. Raises RuntimeError (one line) when it fails or dies first."""
    from queue import Empty

    while True:
        try:
            r = queue.get(timeout=1.0)
        except Empty:
            if not explorer.is_alive():
                raise RuntimeError(f"explorer failed: exit code {explorer.exitcode} before its weights were loaded")
            continue
        if "error" in r:
            raise RuntimeError(f"explorer failed: {r['error']}")
        if r.get("explorer/ready"):
            return


def queued(queue) -> list[dict]:
    """The records the spawned explorer has put on `queue` so far."""
    out = []
    while not queue.empty():
        out.append(queue.get())
    return out


def run_trainer(cfg, model_path: str, rank: int, world: int, device, layout,
                tasks: tuple) -> None:
    """Modes both and train on every trainer rank: build the Trainer (resumed with
    --resume) and, on rank 0, what its loop talks to (`loop_io`) and, in mode both, the
    explorer process (`start_explorer`, handed `tasks`); run the loop (`TrainLoop`); then, on rank 0,
    wait for the explorer and write the final files and the plot (`finish`)."""
    torch.set_num_threads(cfg.trainer_threads)
    trainer = Trainer(cfg, model_path, device)
    state = resume_state(cfg.run_dir) if cfg.resume else None
    start = load_resume_state(trainer, state) if state else 0
    io, explorer, weights = LoopIO(), None, None
    if rank == 0:
        io = loop_io(cfg, trainer, start, model_path)
    loop = TrainLoop(cfg, trainer, start, io, rank, world)
    annotating = threading.Event()
    try:
        if rank == 0 and cfg.annotation:
            from losses import resolve

            io.extra_metrics = resolve(ANNOTATOR, {}, "annotation")(cfg, trainer.tokenizer, annotating)
        if rank == 0 and cfg.mode == "both":
            explorer, weights = start_explorer(cfg, io, str(state / "hf") if state else model_path, trainer.version,
                                               layout, tasks)
        if cfg.mode == "train" and cfg.sync_method == "broadcast":
            params = trainer.full_parameters() if trainer.version else None  # every rank gathers
            if rank == 0:
                weights = connect_explorers(cfg, io, layout, trainer.version, params)
        loop.run()
        if rank == 0:
            finish(cfg, loop, explorer, weights)
    except BaseException:
        loop.bar.close()
        if explorer is not None:
            stop_explorer(explorer, loop)
        raise
    finally:
        annotating.set()
        if io.metrics is not None:
            io.metrics.close()


def kept_on_resume(start: int, evals_from_buffer: bool) -> Callable[[dict], bool]:
    """On --resume from step `start`: which records already in metrics.jsonl stay, so that
    the resumed run logs each step and each evaluation once. Kept: step records of steps <
    `start` (the later ones are trained again), weight receipts of versions <= `start` (the
    explorer starts with version `start`), evaluations of versions < `start` (mode both: the
    respawned explorer evaluates its start weights again); with `evals_from_buffer` (mode
    train with explorers: the trainer reads all their evaluations from the buffer again) no
    evaluation."""

    def keep(r: dict) -> bool:
        if "eval/accuracy" in r:
            return not evals_from_buffer and r.get("eval/version", r.get("step", 0)) < start
        if "explorer/received_version" in r:
            return r["explorer/received_version"] <= start
        return r.get("step", 0) < start

    return keep


def loop_io(cfg, trainer, start: int, model_path: str):
    """Rank 0's `LoopIO`: the buffer (experiences served after step `start` go back
    on --resume), the experience pipeline, the metrics log (on --resume without the
    records of what is done again: `kept_on_resume`), offline / expert data (drawn on to
    `start` for a resume: the expert sampler as far as trainer.loop_state["expert_drawn"]
    of the resume state says), and in mode train the explorers' evaluations from the
    buffer. Mode both adds the explorer in `start_explorer`; mode train with broadcast sync
    the explorers' group in `connect_explorers`."""
    from losses import resolve

    run_dir = Path(cfg.run_dir)
    io = LoopIO(buffer=open_buffer(cfg.buffer, run_dir))
    if cfg.experience_pipeline:
        io.shape = resolve("extras.pipelines.ExperiencePipeline", {}, "experience_pipeline")(
            cfg.experience_pipeline, trainer.tokenizer, model_path)
    io.buffer.set_run_state("trainer_done", None)  # a trainer is running (again)
    if cfg.resume:
        released = io.buffer.release_after(start)
        print0(f"resumed at step {start} (version {trainer.version}); {released} experiences served again")
    evals_from_buffer = cfg.mode == "train" and not cfg.train_data  # (records() below reads them all again)
    io.metrics = Metrics(run_dir, cfg, kept_on_resume(start, evals_from_buffer) if cfg.resume else None)
    if cfg.expert_fraction:
        io.expert = resolve("extras.offline.sampler", {}, "expert_data")(cfg.expert_data, trainer.tokenizer, cfg.seed,
                                                                          chats_only=True)
        io.expert.draw(trainer.loop_state.get("expert_drawn", 0))  # the same order as an uninterrupted run
    if cfg.train_data:
        io.offline = resolve("extras.offline.sampler", {}, "train_data")(cfg.train_data, trainer.tokenizer, cfg.seed)
        for _ in range(start):  # the same order as an uninterrupted run
            io.offline.draw(cfg.batch_size)
    elif cfg.mode == "train":  # the explorers' evaluations, from the buffer
        last = 0

        def records() -> list[dict]:
            nonlocal last
            last, new = io.buffer.records_after(last)
            return new

        io.records = records
    return io


def start_explorer(cfg, io, model_path: str, version: int, layout, tasks: tuple):
    """Mode both, rank 0: spawn the explorer process (explorer.run_mode_both) on the weights
    in `model_path` (= `version`) and the `tasks` prepare built on the device `layout` gives it, join the weight-sync group with it (or, with checkpoint
    sync, wait until it has loaded them), and connect `io` to it. Returns (process, the
    sync.WeightSync or None)."""
    import torch.multiprocessing as mp

    from explorer import run_mode_both

    weights = weight_group(cfg, layout, 1) if cfg.sync_method != "checkpoint" else None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    share = layout.explorer == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) == 1  # cores of one machine, one rank
    flags = ctx.Array("i", 2) if share else None
    explorer = ctx.Process(target=run_mode_both, name="explorer",
                           args=(cfg, model_path, tasks, weights.port if weights else 0, cfg.steps, queue, version,
                                 layout.explorer, layout.sync_device, flags))
    explorer.start()
    if flags is not None:
        io.cores = sync.CoreShare(flags, 0, cfg.trainer_threads, cfg.explorer_threads)
    io.alive, io.records = explorer.is_alive, lambda: queued(queue)
    if weights:
        weights.connect(io.alive)
        io.send_weights = lambda v, buckets: weights.send(v, buckets, io.alive)
    else:  # it may start from a resume state that the first save_resume_state deletes: wait until it is loaded
        wait_until_loaded(explorer, queue)
    return explorer, weights


def weight_group(cfg, layout, receivers: int):
    """Trainer rank 0's end of the weight-sync group (sync.WeightSync, rank 0) for
    `receivers` explorers: its store on cfg.sync_host:cfg.sync_port, on the placement's
    sync device, with --sync-bucket-mb's buckets."""
    return sync.WeightSync(0, 1 + receivers, port=cfg.sync_port, host=cfg.sync_host, device=layout.sync_device,
                           timeout_s=cfg.sync_timeout_s, bucket_elems=bucket_elems(cfg))


def connect_explorers(cfg, io, layout, version: int, params) -> "object":
    """Mode train with broadcast sync, rank 0: host the weight-sync store on
    cfg.sync_host:cfg.sync_port, wait (up to sync_timeout_s) until cfg.num_explorers
    `--mode explore` launches have joined the group, send them `params` (= `version`) if
    this trainer was resumed (they start from the model), and connect `io` to the group.
    Returns the sync.WeightSync."""
    weights = weight_group(cfg, layout, cfg.num_explorers)
    print0(f"weight sync: waiting for {cfg.num_explorers} explorer(s) at {cfg.sync_host}:{weights.port}")
    weights.connect()
    if weights.device.type != layout.sync_device:  # sync.group_backend
        print0("weight sync: an explorer shares trainer rank 0's GPU, where NCCL cannot have two ranks: the weights "
               "go through host memory (gloo)")
    io.send_weights = weights.send
    if params is not None:
        weights.send(version, [params])
    return weights


def finish(cfg, loop, explorer, weights) -> None:
    """Rank 0 after the last step: wait until the explorer has the final weights and has
    ended (RuntimeError with its error line if it failed), then set trainer_done in the buffer, write the
    config next to the final weights, delete the resume states (unless cfg.keep_resume_state; one line
    says so) and write the plot. Mode train with broadcast sync: the
    explorers have the final weights, and trainer_done tells them to leave the group; the
    store (in this process) stays until they have, up to sync_timeout_s."""
    run_dir = Path(cfg.run_dir)
    if weights:
        weights.wait(loop.io.alive)
    if explorer:
        join_draining(explorer, loop.drain)  # drained while it exits: join, then drain, can deadlock
        if explorer.exitcode != 0:
            raise RuntimeError(f"explorer failed: {loop.errors[0] if loop.errors else explorer.exitcode}")
    loop.io.buffer.set_run_state("trainer_done", str(loop.trainer.version))
    if weights and not explorer and not weights.wait_left(cfg.sync_timeout_s):
        print(f"run.py: warning: not every explorer left the weight-sync group within {cfg.sync_timeout_s:.0f} s",
              file=sys.stderr)
    (run_dir / "final" / "nanorft_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    if not cfg.keep_resume_state and (freed := delete_resume_states(run_dir)):
        print0(f"resume state deleted ({freed / 2 ** 20:.0f} MiB), the run has finished: --keep-resume-state keeps it")
    board = f" (TensorBoard: tensorboard --logdir {run_dir})" if "tensorboard" in trackers(cfg) else ""
    print0(f"final weights: {run_dir / 'final'}\nplot: {plot(run_dir)}\nmetrics: {run_dir / 'metrics.jsonl'}{board}")


def join_draining(process, drain: Callable[[], Any], timeout_s: float | None = None) -> bool:
    """Wait until `process` has exited, calling `drain()` (which reads its queue) while
    waiting and once more after: a process that has put items on a multiprocessing queue
    does not exit until they are read (the multiprocessing docs' "joining processes that
    use queues"), so join-then-drain can deadlock. Gives up after `timeout_s` seconds (None:
    no limit). Returns whether it has exited."""
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
    """The trainer failed: stop the explorer with it. If the explorer had failed first, raise
    its error line (RuntimeError) instead."""
    if explorer.is_alive():
        explorer.terminate()
        if not join_draining(explorer, loop.io.records, 30):  # its records are dropped: the trainer's error counts
            print("run.py: warning: the explorer did not stop within 30 s of SIGTERM; killed", file=sys.stderr)
            explorer.kill()
            explorer.join()
    else:  # the trainer noticed that the explorer failed: its reason is on the queue
        loop.drain()
        if loop.errors:
            raise RuntimeError(f"explorer failed: {loop.errors[0]}") from None


