"""nanorft: reinforcement fine-tuning of LLMs. The table of modes (MODES) and `prepare`, which checks
every input before any process starts.

    torchrun run.py --mode both --sync-interval 2     # the default job (python run.py: the same)
    torchrun --nproc_per_node 2 run.py --mode both    # two FSDP trainer ranks
    python run.py --help                              # every setting (config.py), with its help
"""

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import launch
from config import Config, parse_config
from losses import resolve
from metrics import print0, trackers
from perf import announce_peak


class Prepared(NamedTuple):
    """The model directory (rank 0; None elsewhere), the tasks (train, held-out, verifier dataset), the placement."""

    model_path: str | None
    tasks: tuple
    layout: launch.Placement


def trainer_ranks(cfg: Config, prepared: Prepared) -> None:
    """Modes both and train: each trainer rank runs loop.run_trainer (mode both: rank 0 spawns the explorer)."""
    import torch.distributed as dist

    from loop import run_trainer

    rank, world, device = launch.init_distributed()
    shared = [prepared.model_path]
    dist.broadcast_object_list(shared, src=0)
    launch.split_threads(cfg, world)
    explorer = (
        "no explorer"
        if cfg.mode == "train"
        else f"explorer: engine {cfg.engine} x {cfg.explorer_threads} threads"
    )
    print0(
        f"nanorft: mode {cfg.mode}, {world} trainer rank(s) x {cfg.trainer_threads} threads, {explorer}, "
        f"model {shared[0]}, run dir {cfg.run_dir}\nplacement: {prepared.layout.describe(cfg.sync_method)}"
    )
    try:
        run_trainer(cfg, shared[0], rank, world, device, prepared.layout, prepared.tasks)
        dist.barrier()  # the ranks leave together: none tears the group down while rank 0 still finishes
    finally:
        dist.destroy_process_group()


# mode -> what it starts; explore (one explorer beside a train launch) and bench (evaluation only) by import path
MODES = {
    "both": trainer_ranks,
    "train": trainer_ranks,
    "explore": "extras.explore_mode.run_mode_explore",
    "bench": "extras.bench.bench",
}


# the losses that need no behaviour log-probs: offline rows carry none (MIX's expert rows: --expert-data)
OFFLINE_LOSSES = ("sft", "dpo")


def check_modes(cfg: Config) -> None:
    """Resolve sync_method "auto" (mode both: in prepare); ValueError: conflicting flags; FileNotFoundError: no run."""
    if cfg.sync_method == "auto" and cfg.mode != "both":
        cfg.sync_method = "checkpoint"
    if cfg.mode in ("explore", "train") and cfg.sync_method == "broadcast" and not cfg.sync_port:
        raise ValueError(
            f"mode {cfg.mode} with --sync-method broadcast needs --sync-port (the same on trainer and "
            "explorers) and, across hosts, --sync-host (the trainer host's address)"
        )
    if cfg.inflight and cfg.mode not in ("both", "explore"):
        raise ValueError("--inflight is a setting of the explorer (mode both or explore)")
    bound = cfg.sync_offset + cfg.sync_interval - 1
    if cfg.mode == "both" and 0 <= cfg.max_staleness < bound:
        raise ValueError(
            f"max_staleness {cfg.max_staleness} < sync_offset + sync_interval - 1 = {bound}: "
            "in mode both the schedule itself produces experiences that old"
        )
    if cfg.max_staleness < -1:
        raise ValueError(f"max_staleness must be >= 0, or -1 for no bound, got {cfg.max_staleness}")
    if cfg.bench_models and cfg.mode != "bench":
        raise ValueError("--bench-models is for --mode bench")
    if cfg.train_data and cfg.mode != "train":
        raise ValueError("--train-data is for --mode train (offline SFT / DPO)")
    if cfg.train_data and cfg.policy_loss not in OFFLINE_LOSSES:
        raise ValueError(
            f"--train-data has no behaviour log-probs for policy_loss {cfg.policy_loss!r} to take a "
            f"ratio against: train offline data with --policy-loss {' or '.join(OFFLINE_LOSSES)}"
        )
    if cfg.train_data and cfg.sync_method == "broadcast":
        raise ValueError(
            "--train-data trains offline, with no explorer to sync with: leave out --sync-method broadcast"
        )
    if (
        cfg.overwrite and cfg.mode in ("explore", "train") and not cfg.train_data
    ):  # (offline: no other side)
        raise ValueError(
            f"--overwrite would delete a run directory shared with the other side (mode {cfg.mode})"
        )
    if (
        cfg.resume and cfg.mode in ("both", "train") and not Path(cfg.run_dir).is_dir()
    ):  # (without a buffer: step 0)
        raise FileNotFoundError(f"--resume: no run to resume in {cfg.run_dir} (no such directory)")


def finished_run(cfg: Config) -> bool:
    """Whether --resume names a finished run (final config written, resume state deleted)."""
    from checkpoints import resume_state

    return (
        cfg.resume
        and cfg.mode in ("both", "train")
        and resume_state(cfg.run_dir) is None
        and (Path(cfg.run_dir) / "final" / "nanorft_config.json").is_file()
    )


def prepare(cfg: Config, rank: int) -> Prepared:
    """Check every input, build the tasks once; a run of its own refuses a non-empty run dir (FileExistsError)."""
    from transformers import AutoTokenizer

    import buffer
    import explorer
    import models
    import trainer
    import workflows

    check_modes(cfg)
    trainer.check_config(cfg)
    workflows.check_pipelines(cfg)
    trackers(cfg)
    gpus = launch.gpu_count()
    layout = launch.place(gpus, int(os.environ.get("WORLD_SIZE", "1")), cfg.mode)
    cfg.dtype, why = models.choose_dtype(cfg.dtype, "cuda" if gpus else "cpu")
    print0(
        f"nanorft: preparing mode {cfg.mode}: precision {cfg.dtype} ({why}); memory allocator "
        f"{launch.allocator_banner(cfg)}; model {cfg.model}; "
        f"task {cfg.task} ({cfg.train_size} training + {cfg.eval_size} held-out tasks)"
    )
    if (
        int(os.environ.get("LOCAL_RANK", "0")) == 0
    ):  # measured once per machine, before any process uses it
        announce_peak("cuda" if gpus else "cpu", cfg.dtype)
    model_path = models.resolve_model(cfg.model) if rank == 0 else None
    tasks = workflows.prepare_tasks(cfg)
    tok = AutoTokenizer.from_pretrained(model_path) if rank == 0 else None
    explorer.check_config(cfg, tok, tasks[2])
    cfg.sync_method = launch.sync_method(cfg, layout)
    if rank == 0 and cfg.teacher:
        resolve(trainer.TEACHER, {}, "teacher").check(cfg, tok)
    if rank == 0 and (cfg.expert_fraction or cfg.train_data):
        resolve("extras.offline.check_offline_data", {}, "offline data")(cfg, tok)
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        alone = cfg.mode == "both" or bool(
            cfg.train_data
        )  # a run dir of its own (offline train: no explorers)
        if alone and not cfg.resume and run_dir.exists() and any(run_dir.iterdir()):
            if not cfg.overwrite:
                raise FileExistsError(
                    f"run_dir {run_dir} is not empty (use --overwrite, --resume or another --run-dir)"
                )
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.mode != "bench":
            buffer.check_config(cfg)
        name = (
            "config.json" if alone else f"config_{cfg.mode}.json"
        )  # launches sharing the run dir: one file each
        (run_dir / name).write_text(
            json.dumps(
                {
                    **dataclasses.asdict(cfg),
                    "placement": dataclasses.asdict(layout),
                    "precision": why,
                },
                indent=2,
            )
        )
    return Prepared(model_path, tasks, layout)


def main(argv: list[str] | None = None) -> int:
    """Parse, check, run the mode; the exit code: 2 (one line) for bad input, 1 for a failed run, 130: Ctrl-C."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    # plug-ins by import path (--workflow mymod.MyWorkflow) from the working directory, last: never shadowing ours
    if not any(os.path.abspath(p or ".") == os.getcwd() for p in sys.path):
        sys.path.append(os.getcwd())
    os.environ.setdefault(
        "HF_HUB_DISABLE_PROGRESS_BARS", "1"
    )  # transformers' loading bars would break the step bar
    try:
        cfg = parse_config(argv)
        if finished_run(cfg):
            print0(
                f"nanorft: the run in {cfg.run_dir} has finished (final weights in {Path(cfg.run_dir) / 'final'}): "
                "nothing to resume"
            )
            return 0
        if cfg.mode == "bench":  # its errors are the user's input: exit code 2
            return resolve(MODES["bench"], {}, "mode")(cfg)
        prepared = prepare(cfg, rank)
    except (ValueError, OSError) as e:  # bad input: flags, files, directories
        print(f"run.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return launch.guarded(cfg, rank, lambda: resolve(MODES[cfg.mode], {}, "mode")(cfg, prepared))


if __name__ == "__main__":
    launch.preload_allocator(sys.argv[1:])
    if (
        code := main()
    ) == 130:  # Ctrl-C: a collective in flight would hang finalization (gloo joins its thread)
        (
            sys.stdout.flush(),
            sys.stderr.flush(),
            os._exit(code),
        )  # no finalizers: kill -9 loses nothing either
    sys.exit(code)
