"""nanorft: reinforcement fine-tuning of LLMs. The two cycles: `rl_loop` (the trainer's, modes
both and train) and `explorer_loop` (the explorer's, in its own process); `prepare` checks every
input before any process starts; `main` runs the mode. Together with components.py, the
composition root: the only place that names the optional parts of extras/.

    torchrun run.py --mode both --sync-interval 2     # the default job (python run.py: the same)
    torchrun --nproc_per_node 2 run.py --mode both    # two FSDP trainer ranks
    python run.py --help                              # every setting (config.py), with its help
"""

import contextlib
import dataclasses
import functools
import json
import multiprocessing.util
import os
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
from transformers.utils import logging as transformers_logging

import components
import launch
import loop
import models
import perf
from checkpoints import load_resume_state, resume_state, save_resume_state
from config import Config, parse_config, task_preset
from metrics import print0
from perf import announce_peak
from schedule import publishes_after, required_version, staleness_bound


class Prepared(NamedTuple):
    """The model directory (rank 0; None elsewhere), the tasks (train, held-out, verifier
    dataset), the placement."""

    model_path: str | None
    tasks: tuple
    layout: launch.Placement


def rl_loop(cfg: Config, trainer, reader, publisher, log, start: int) -> None:
    """The RL cycle on one trainer rank, one step per explorer batch from `start` to cfg.steps
    (`trainer`: trainer.Trainer; `reader`: loop.BatchReader; `publisher`: sync.SentWeights or
    another publisher; `log`: loop.StepLog). The explorer generates the batches in its own
    process, with the weights the schedule (schedule.py) gives it, and evaluates them."""
    for step in range(start, cfg.steps):
        # the groups of this step, read from the buffer by rank 0 (too stale ones dropped)
        groups, metrics = reader.read(step, trainer.version)
        # advantages -> policy loss (forward, backward) -> optimizer step: weight version + 1
        metrics.update(trainer.step(groups, log.progress))
        # the explorer gets the new weights after every sync_interval steps
        if publishes_after(step, cfg.sync_interval, cfg.steps):
            metrics.update(loop.publish(cfg, trainer, publisher, step))
        if cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0:
            if step < cfg.steps - 1:
                save_resume_state(trainer, cfg.run_dir, step + 1)
        # the explorer's evaluations and batch records join this step's metrics
        log.step(step, metrics, groups, trainer.version)


def explorer_loop(cfg: Config, explorer, buffer, pace, log, batches: int) -> None:
    """The explorer's cycle (`explorer`: explorer.Explorer), from the batch it resumes at up to
    `batches`: for each batch, the weights the schedule asks for (`pace`: schedule.Schedule),
    the rollouts of its tasks written to `buffer`, and an evaluation once a weight version
    reaches a multiple of eval_interval. Records go to `log`."""
    engine = explorer.engine
    first = explorer.resume(buffer)
    evaluated = None  # the weight version last evaluated
    with engine.paced_by(pace.inflight if cfg.inflight else None):
        for batch in range(first, batches):
            # wait for (or load) the weights the schedule asks for; False: the run is over
            if not pace.before_batch(batch):
                break
            # the batch's tasks, drawn by the selector
            plan = explorer.plan_batch(batch, buffer)
            # one group of group_size rollouts per task: the engine samples every token
            groups = explorer.rollout(plan.tasks)
            # the groups -> the buffer, which the trainer reads; the batch's record -> the log
            log(explorer.write_batch(plan, groups, buffer))
            # after the last batch of a version: the trainer trains it while we evaluate
            next_version = required_version(batch + 1, cfg.sync_interval, cfg.sync_offset)
            last_of_version = batch + 1 == batches or engine.version < next_version
            due = evaluated is None or (
                engine.version // cfg.eval_interval > evaluated // cfg.eval_interval
            )
            if last_of_version and due:
                evaluated = evaluate(cfg, explorer, log)
    pace.final()
    if evaluated != engine.version:
        evaluate(cfg, explorer, log)


def evaluate(cfg: Config, explorer, log) -> int:
    """Score the held-out tasks with the engine's weights (no in-flight update meanwhile);
    returns the version evaluated."""
    engine = explorer.engine
    with engine.paced_by(None):
        if cfg.eval_size and (record := explorer.evaluate(engine.version)) is not None:
            log(record)
    return engine.version


def explorer_process(
    cfg: Config,
    model_path: str,
    tasks: tuple,
    port: int | None,
    queue,
    start_version: int,
    layout: launch.Placement,
    core_flags=None,
) -> None:
    """Mode both's explorer process (`port` None: checkpoint sync): builds the engine, the
    weight receiver and the explorer, runs `explorer_loop`; puts metric records, and an error
    line if it fails (exit code 1), on `queue`."""
    parent = os.getppid()
    alive = lambda: os.getppid() == parent  # noqa: E731 - the trainer is our parent
    signal.signal(signal.SIGTERM, launch.exit_quietly)
    # Ctrl-C: the trainer says how to resume; no second report
    signal.signal(signal.SIGINT, launch.exit_quietly)
    try:
        queue.put({"status": f"starting the {cfg.engine} engine"})
        status = lambda text: queue.put({"status": text})  # noqa: E731
        engine = components.explorer_engine(cfg, model_path, layout, start_version, status)
        receiver = components.receiver(cfg, engine, queue.put, alive, port, layout.sync_device)
        pace = components.explorer_pace(cfg, engine, receiver, core_flags)
        buffer = components.open_buffer(cfg)
        try:
            pace.join()
            explorer = components.make_explorer(cfg, engine, tasks, queue.put)
            explorer_loop(cfg, explorer, buffer, pace, queue.put, cfg.steps)
        finally:
            engine.close()
    except Exception as e:  # reported by the trainer as one line; the process exits with code 1
        log = Path(cfg.run_dir) / f"error_{cfg.explorer_name}.log"
        log.write_text(traceback.format_exc())
        queue.put({"error": f"{type(e).__name__}: {e} (traceback: {log})"})
        queue.close()
        queue.join_thread()
        sys.exit(1)
    except SystemExit:
        # SIGTERM, Ctrl-C (launch.exit_quietly): multiprocessing's exit handlers, then no
        # teardown of the weight-sync group, whose destructor would wait for a broadcast that
        # never comes
        queue.cancel_join_thread()
        multiprocessing.util._exit_function()
        os._exit(1)


def train(cfg: Config, prepared: Prepared) -> None:
    """Modes both and train, on each trainer rank: the RL loop (mode both: rank 0 spawns the
    explorer; mode train: the explorers are launches of their own)."""
    import torch.distributed as dist

    rank, world, device = launch.init_distributed()
    # rank 0's model directory and run dir (a free one it chose: prepare)
    shared = [prepared.model_path, cfg.run_dir]
    dist.broadcast_object_list(shared, src=0)
    model_path, cfg.run_dir = shared
    launch.split_threads(cfg, world)
    if cfg.mode == "train":
        explorer = "no explorer"
    else:
        explorer = f"explorer: engine {cfg.engine} x {cfg.explorer_threads} threads"
    print0(
        f"nanorft: mode {cfg.mode}, {world} trainer rank(s) x {cfg.trainer_threads} threads, "
        f"{explorer}, model {model_path}, run dir {cfg.run_dir}\n"
        f"placement: {prepared.layout.describe(cfg.sync_method)}"
    )
    the_run = started(cfg, model_path, rank, world, device, prepared.layout, prepared.tasks)
    try:
        with the_run as (trainer, reader, publisher, log, start):
            rl_loop(cfg, trainer, reader, publisher, log, start)
        # the ranks leave together: none tears the group down while rank 0 still finishes
        dist.barrier()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def started(cfg, model_path: str, rank: int, world: int, device, layout, tasks):
    """Modes both and train on this trainer rank: yields (the resumed Trainer, its BatchReader,
    its weight publisher, its StepLog, the first step) with the explorer (mode both, rank 0,
    running `explorer_process`; stopped on an error) or the explorers' group (mode train)
    running; on leaving, rank 0 waits for the explorers and writes the final files."""
    torch.set_num_threads(cfg.trainer_threads)
    trainer = components.make_trainer(cfg, model_path, device)
    if cfg.return_memory:
        perf.return_free_memory(trainer.model, trainer.opt)
    state = resume_state(cfg.run_dir) if cfg.resume else None
    start = load_resume_state(trainer, state) if state else 0
    reader, log = components.reader_and_log(
        cfg, trainer, start, model_path, rank, world, layout, device
    )
    explorer = weights = None
    annotating = threading.Event()
    try:
        extra_metrics = dict
        if rank == 0 and cfg.annotation:
            from extras.label_studio import start_annotator

            extra_metrics = start_annotator(cfg, trainer.tokenizer, annotating)
        explorers = loop.Explorers()
        send = None
        if rank == 0 and cfg.mode == "both":
            explorer_model = str(state / "hf") if state else model_path
            wait_loaded = None
            if cfg.sync_method == "checkpoint":
                from extras.checkpoint_sync import wait_until_loaded as wait_loaded
            explorer, weights, explorers = loop.start_explorer(
                cfg,
                explorer_model,
                trainer.version,
                layout,
                tasks,
                explorer_process,
                components.transport(cfg),
                wait_loaded,
            )
            if weights:
                send = functools.partial(weights.send, alive=explorers.alive)
        if cfg.mode == "train" and not cfg.train_data:
            from extras.train_mode import connect_explorers

            connected = connect_explorers(
                cfg, log.buffer, layout, trainer, rank, components.transport(cfg)
            )
            weights, explorers = connected
            send = weights.send if weights else None
        if explorers.cores is not None:  # threads the explorer lends while it waits
            perf.lend_threads(trainer.model, explorers.cores)
            if send is not None:  # and the trainer's, while a publish waits for the explorer
                send = perf.lending(send, explorers.cores)
        publisher = components.publisher(cfg, rank, send)
        log.connect(explorers, extra_metrics)
        reader.connect(explorers, log.waiting)
        yield trainer, reader, publisher, log, start
        log.bar.close()
        if rank == 0:
            board = "tensorboard" in components.tracker_names(cfg)
            loop.finish(cfg, log, trainer.version, explorer, weights, board)
    except BaseException:
        log.bar.close()
        if explorer is not None:
            loop.stop_explorer(explorer, log.records)
        raise
    finally:
        annotating.set()
        if log.metrics is not None:
            log.metrics.close()


def explore(cfg: Config, prepared: Prepared) -> None:
    """Mode explore: one explorer beside a `--mode train` launch, running `explorer_loop`."""
    from extras.explore_mode import run_mode_explore

    run_mode_explore(
        cfg,
        prepared,
        explorer_loop,
        components.make_engine,
        components.make_explorer,
        components.receiver,
        components.open_buffer,
    )


MODES = {"both": train, "train": train, "explore": explore}


def check_modes(cfg: Config) -> None:
    """Resolve sync_method "auto" (mode both: in prepare); ValueError: conflicting flags;
    FileNotFoundError: no run."""
    # the checks of modes explore, train, bench and of --train-data, which a default run skips
    if cfg.mode != "both" or cfg.train_data:
        from extras.train_mode import check_config

        check_config(cfg)
    bound = staleness_bound(cfg)
    if cfg.mode == "both" and 0 <= cfg.max_staleness < bound:
        raise ValueError(
            f"max_staleness {cfg.max_staleness} < sync_offset + sync_interval - 1 = {bound}: "
            "in mode both the schedule itself produces experiences that old"
        )
    if cfg.max_staleness < -1:
        raise ValueError(f"max_staleness must be >= 0, or -1 for no bound, got {cfg.max_staleness}")
    if cfg.bench_models and cfg.mode != "bench":
        raise ValueError("--bench-models is for --mode bench")
    # (without a buffer: step 0)
    if cfg.resume and cfg.mode in ("both", "train") and not Path(cfg.run_dir).is_dir():
        raise FileNotFoundError(f"--resume: no run to resume in {cfg.run_dir} (no such directory)")


def finished_run(cfg: Config) -> bool:
    """Whether --resume names a finished run (final config written, resume state deleted)."""
    return (
        cfg.resume
        and cfg.mode in ("both", "train")
        and resume_state(cfg.run_dir) is None
        and (Path(cfg.run_dir) / "final" / "nanorft_config.json").is_file()
    )


def runs_alone(cfg: Config) -> bool:
    """Whether the run has its run dir to itself: mode both, or offline mode train (no
    explorers)."""
    return cfg.mode == "both" or bool(cfg.train_data)


def own_run_dir(cfg: Config) -> str:
    """cfg.run_dir; or, for a run that has its run dir to itself, when the default run dir (no
    --run-dir given, no --overwrite or --resume) holds an earlier run: the first free of
    RUN_DIR-2, RUN_DIR-3, ..., so that the same command run again just works."""
    if "run_dir" in cfg.given or cfg.overwrite or cfg.resume or not runs_alone(cfg):
        return cfg.run_dir
    run_dir = cfg.run_dir
    n = 1
    while Path(run_dir).is_dir() and any(Path(run_dir).iterdir()):
        n += 1
        run_dir = f"{Path(cfg.run_dir)}-{n}"
    return run_dir


def prepare(cfg: Config, rank: int) -> Prepared:
    """Check every input, build the tasks once; a run of its own refuses a non-empty run dir
    (FileExistsError)."""
    from transformers import AutoTokenizer

    check_modes(cfg)
    earlier = cfg.run_dir
    cfg.run_dir = own_run_dir(cfg)
    if cfg.run_dir != earlier:
        print0(f"nanorft: {earlier} holds an earlier run: this run writes to {cfg.run_dir}")
    components.check_trainer(cfg)
    components.check_pipelines(cfg)
    components.tracker_names(cfg)
    gpus = launch.gpu_count()
    layout = launch.place(gpus, int(os.environ.get("WORLD_SIZE", "1")), cfg.mode)
    cfg.dtype, why = models.choose_dtype(cfg.dtype, "cuda" if gpus else "cpu")
    preset = task_preset(cfg.task, cfg.given)
    if preset:
        shown = ", ".join(f"{k} {v!r}" for k, v in preset.items())
        print0(
            f"nanorft: task {cfg.task}: {shown} (the defaults are basic_arithmetic's; give them "
            "to change)"
        )
    print0(
        f"nanorft: preparing mode {cfg.mode}: precision {cfg.dtype} ({why}); memory allocator "
        f"{launch.allocator_banner(cfg)}; model {cfg.model}; "
        f"task {cfg.task} ({cfg.train_size} training + {cfg.eval_size} held-out tasks)"
    )
    if cfg.mode != "explore":
        compiles, reason = perf.compiles_layers(cfg, "cuda" if gpus else "cpu")
        done = "compiled by torch.compile" if compiles else "run eagerly"
        print0(f"nanorft: the trainer's decoder blocks {done} ({reason})")
    # measured once per machine, before any process uses it
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        announce_peak("cuda" if gpus else "cpu", cfg.dtype)
    model_path = components.resolve_model(cfg.model) if rank == 0 else None
    tasks = components.tasks(cfg)
    tok = AutoTokenizer.from_pretrained(model_path) if rank == 0 else None
    components.check_explorer(cfg, tok, tasks[2])
    cfg.sync_method = components.sync_method(cfg, layout)
    if rank == 0:
        components.check_teacher(cfg, tok)
    if rank == 0 and (cfg.expert_fraction or cfg.train_data):
        from extras.offline import check_offline_data

        check_offline_data(cfg, tok)
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        alone = runs_alone(cfg)
        if alone and not cfg.resume and run_dir.exists() and any(run_dir.iterdir()):
            if not cfg.overwrite:
                raise FileExistsError(
                    f"run_dir {run_dir} is not empty (use --overwrite, --resume or another "
                    "--run-dir)"
                )
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.mode != "bench":
            components.check_buffer(cfg)
        # launches sharing the run dir: one file each
        name = "config.json" if alone else f"config_{cfg.mode}.json"
        record = {**dataclasses.asdict(cfg), "placement": dataclasses.asdict(layout)}
        record["precision"] = why
        (run_dir / name).write_text(json.dumps(record, indent=2))
    return Prepared(model_path, tasks, layout)


def main(argv: list[str] | None = None, leave_on_interrupt: bool = False) -> int:
    """Parse, check, run the mode. Exit code 2 (one line): bad input; 1: a failed run;
    130: Ctrl-C."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    # oneDNN keeps a primitive per shape of a product (1,024): 64 bound the trainer's memory
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    # the compiled blocks' kernels beside the converted model: a first run builds them, later
    # runs load them (inductor's default, /tmp, may be emptied at every boot)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(models.cache_dir() / "inductor"))
    # plug-ins by import path (--workflow mymod.MyWorkflow) from the working directory, last:
    # never shadowing ours
    if not any(os.path.abspath(p or ".") == os.getcwd() for p in sys.path):
        sys.path.append(os.getcwd())
    # transformers' loading bars would break the step bar: off here, where transformers was
    # imported before, and in the processes this one starts (unless the user asks for them)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        transformers_logging.disable_progress_bar()
    try:
        cfg = parse_config(argv)
        if finished_run(cfg):
            print0(
                f"nanorft: the run in {cfg.run_dir} has finished (final weights in "
                f"{Path(cfg.run_dir) / 'final'}): nothing to resume"
            )
            return 0
        if cfg.mode == "bench":  # its errors are the user's input: exit code 2
            from extras.bench import bench

            return bench(cfg, prepare, components.make_engine, components.explorer_parts)
        prepared = prepare(cfg, rank)
    except (ValueError, OSError) as e:  # bad input: flags, files, directories
        print(f"run.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return launch.guarded(cfg, rank, lambda: MODES[cfg.mode](cfg, prepared), leave_on_interrupt)


if __name__ == "__main__":
    launch.preload_allocator(sys.argv[1:])
    sys.exit(main(leave_on_interrupt=True))
