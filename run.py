"""nanorft entry point: the mode flags and the processes of each mode.

    python run.py                                         # one trainer rank + explorer
    torchrun run.py --mode both --sync-interval 2         # same, under torchrun
    torchrun --nproc_per_node 2 run.py --mode both        # two FSDP trainer ranks
    python run.py --config configs/tiny.toml --help       # every setting, with its help

Settings (config.py): dataclass defaults < `--config FILE.toml` < command-line flags. The
resolved config is saved to RUN_DIR/config.json (modes both and train with --train-data;
the launches of the fully asynchronous modes train and explore, which share RUN_DIR, write
config_train.json and config_explore.json, mode bench config_bench.json) and next to the
final weights (final/nanorft_config.json).

Processes: each trainer rank runs `main`. Rank 0 creates the run directory and the
buffer, hosts the weight-sync TCPStore and spawns the explorer process
(torch.multiprocessing, spawn), then consumes one explorer batch per step (loop.py).
Outputs in RUN_DIR: metrics.jsonl (one record per step plus eval records), samples.log,
buffer.sqlite, plot.png, final/ (Hugging Face safetensors directory).
"""
from __future__ import annotations

import ctypes.util
import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from config import OTHER_TASK_DEFAULTS, Config, coerce, parse_config
from metrics import JsonlLog, job_units, print0, trackers, unit_peak

# ----------------------------------------------------------------------------- processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """Where the processes run (printed at start, recorded in RUN_DIR/config.json).

    trainer: the device of each trainer rank; explorer: the explorer's device (mode both;
    "" otherwise); colocated: the explorer shares trainer rank 0's GPU; sync_device: the
    device type of the weight-sync group: "cuda" (NCCL) between separate GPUs, "cpu"
    (gloo, staged through host memory) on CPU machines and when colocated, where NCCL
    refuses two ranks of one group on one device."""

    trainer: tuple[str, ...]
    explorer: str
    colocated: bool
    sync_device: str
    unused_gpus: int = 0

    def describe(self) -> str:
        where = f"trainer on {', '.join(self.trainer)}"
        if self.explorer:
            where += f"; explorer on {self.explorer}" + (" (colocated with trainer rank 0)" if self.colocated else "")
            where += f"; weight sync {'NCCL' if self.sync_device == 'cuda' else 'gloo'}"
        return where + (f"; {self.unused_gpus} GPU(s) unused" if self.unused_gpus else "")


def place(gpus: int, ranks: int, mode: str) -> Placement:
    """The layout for `gpus` visible GPUs and `ranks` trainer ranks (torchrun
    --nproc_per_node). No GPU: everything on the CPU, gloo. Trainer rank i on cuda:i. Mode
    both: with more GPUs than ranks, the explorer gets the first free one (cuda:ranks; one
    engine on one GPU: the weight-sync group has one receiving rank; more explorers, one per
    GPU, are `--mode explore` launches with CUDA_VISIBLE_DEVICES); with as many GPUs as
    ranks it is colocated on cuda:0 (vLLM takes vllm_memory_fraction of it, the HF engine
    holds bf16 weights) and weights are staged through host memory over gloo. Raises
    ValueError (one line) for fewer GPUs than trainer ranks."""
    if gpus == 0:
        return Placement(("cpu",) * ranks, "cpu" if mode == "both" else "", False, "cpu")
    if ranks > gpus:
        raise ValueError(f"{ranks} trainer ranks need {ranks} GPUs, {gpus} visible (torchrun --nproc_per_node <= GPUs)")
    trainer = tuple(f"cuda:{i}" for i in range(ranks))
    if mode != "both":
        return Placement(trainer, "", False, "cuda", gpus - ranks)
    if gpus == ranks:
        return Placement(trainer, "cuda:0", True, "cpu")
    return Placement(trainer, f"cuda:{ranks}", False, "cuda", gpus - ranks - 1)


def gpu_count() -> int:
    """Visible CUDA devices (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def tcmalloc(cfg: Config) -> str | None:
    """The tcmalloc library to preload (its soname, e.g. libtcmalloc_minimal.so.4), or None
    for the C library's malloc: --allocator system, no tcmalloc installed, or (auto) a GPU.
    On a CPU, glibc's malloc hands each large tensor fresh pages from mmap and returns them
    on free, so a default trainer step faulted in about 18 GB of zeroed pages; tcmalloc keeps
    freed memory for the next step (as vLLM's CPU backend recommends). Raises ValueError
    for --allocator tcmalloc without the library (Debian/Ubuntu: libtcmalloc-minimal4)."""
    if cfg.allocator == "system" or sys.platform != "linux" or (cfg.allocator == "auto" and gpu_count()):
        return None
    lib = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if lib is None and cfg.allocator == "tcmalloc":
        raise ValueError("--allocator tcmalloc: no tcmalloc library found (Debian/Ubuntu: apt-get install "
                         "libtcmalloc-minimal4)")
    return lib


def allocator_in_use() -> str:
    """The allocator this process runs with, for the start banner."""
    return "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "the C library's malloc"


def preload_allocator(argv: list[str]) -> None:
    """Re-execute this process (same pid, arguments and environment, so under torchrun too)
    with tcmalloc in LD_PRELOAD when `tcmalloc` chooses it and it is not loaded yet; the
    explorer process inherits it. Bad flags are left to `main` to report."""
    if allocator_in_use() == "tcmalloc" or {"-h", "--help"} & set(argv):
        return
    try:
        lib = tcmalloc(parse_config(argv))
    except (ValueError, OSError):
        return
    if lib:
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [lib, os.environ.get("LD_PRELOAD", "")]))
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def init_distributed():
    """Initialise the default (FSDP) group from torchrun's env, or as a single rank when
    started with plain python. Returns (rank, world_size, device)."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    gloo_interface()  # on GPUs too: the gloo half of "cpu:gloo,cuda:nccl" binds as gloo alone would
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        # gloo beside NCCL: a CPU tensor in a collective (a resume's checkpoint metadata, say) would otherwise raise
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timedelta(hours=1))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(hours=1))
    return dist.get_rank(), dist.get_world_size(), device


def gloo_interface() -> str | None:
    """Gloo's sockets bind the address of this machine's hostname, often loopback (Debian's
    /etc/hosts maps it to 127.0.1.1), where the ranks of another node cannot reach them: set
    GLOO_SOCKET_IFNAME (unless given) to the interface on the route to MASTER_ADDR, as the
    weight-sync group does (sync.local_address). Returns the interface, or None when the
    variable was left alone (set already; MASTER_ADDR missing, on loopback or unresolvable)."""
    import sync

    master = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("GLOO_SOCKET_IFNAME") or not master:
        return None
    try:
        name = sync.interface_of(sync.local_address(master))
    except OSError:  # no route to it: torch's own error names the address
        return None
    if name is None or name == "lo":
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def split_threads(cfg: Config, world: int) -> None:
    """Fill 0 thread counts: the explorer and the `world` trainer ranks share the cores (an
    explore launch leaves the trainer's share to a train launch beside it); offline training
    (mode train with --train-data) has no explorer, and its ranks take all the cores."""
    cores = os.cpu_count() or 1
    offline = cfg.mode == "train" and bool(cfg.train_data)
    if cfg.explorer_threads == 0:
        cfg.explorer_threads = max(1, cores // (world + 1))
    if cfg.trainer_threads == 0:
        cfg.trainer_threads = max(1, (cores - (0 if offline else cfg.explorer_threads)) // world)


def check_modes(cfg: Config) -> None:
    """Raise ValueError (one line) for a mode combination that cannot work (the sync
    settings: sync.check_config), FileNotFoundError for --resume without a run."""
    import sync

    sync.check_config(cfg)
    if cfg.bench_models and cfg.mode != "bench":
        raise ValueError("--bench-models is for --mode bench")
    if cfg.train_data and cfg.mode != "train":
        raise ValueError("--train-data is for --mode train (offline SFT / DPO)")
    if cfg.train_data and cfg.sync_method == "broadcast":
        raise ValueError("--train-data trains offline, with no explorer to sync with: leave out --sync-method broadcast")
    if cfg.overwrite and cfg.mode in ("explore", "train") and not cfg.train_data:  # (offline: no other side)
        raise ValueError(f"--overwrite would delete a run directory shared with the other side (mode {cfg.mode})")
    if cfg.resume and cfg.mode in ("both", "train") and not Path(cfg.run_dir).is_dir():
        # (a run directory without a buffer yet, killed while starting, resumes from step 0)
        raise FileNotFoundError(f"--resume: no run to resume in {cfg.run_dir} (no such directory)")


def finished_run(cfg: Config) -> bool:
    """Whether --resume (modes both and train) names a run that has finished: its final
    config written (final/nanorft_config.json) and its resume state deleted. main then says
    so and exits 0; resuming it from step 0 would train the finished run again."""
    from checkpoints import resume_state

    return (cfg.resume and cfg.mode in ("both", "train") and resume_state(cfg.run_dir) is None
            and (Path(cfg.run_dir) / "final" / "nanorft_config.json").is_file())


def prepare(cfg: Config, rank: int) -> tuple[str, tuple]:
    """Validate inputs before any process starts, each module its own settings (modes and
    sync, algorithm, pipelines, trackers, placement, model, tasks, engine, workflow,
    offline data), then the run dir: a run of its own (mode both, offline mode train) refuses
    a non-empty one (FileExistsError) unless --resume, or --overwrite, which deletes it
    first; the resolved config goes to RUN_DIR/config.json there, else (the fully
    asynchronous launches sharing it, bench) to config_<mode>.json. Returns the model directory (rank 0) and the tasks
    (workflows.prepare_tasks: train, held-out, verifier dataset), built here once for every
    process of this launch (a countdown set of 2,000 takes about 35 s)."""
    import buffer
    import explorer
    import models
    import pipelines
    import trainer
    import workflows
    from transformers import AutoTokenizer

    check_modes(cfg)
    trainer.check_config(cfg)
    pipelines.check_config(cfg)
    trackers(cfg)
    layout = place(gpu_count(), int(os.environ.get("WORLD_SIZE", "1")), cfg.mode)  # ValueError: a layout that cannot work
    cfg.dtype, why = models.choose_dtype(cfg.dtype, "cuda" if gpu_count() else "cpu")
    lib = tcmalloc(cfg)  # ValueError: --allocator tcmalloc without the library
    hint = "" if lib or cfg.allocator == "system" or gpu_count() else (
        ": install libtcmalloc-minimal4 for a faster CPU trainer (--allocator)")
    print0(f"nanorft: preparing mode {cfg.mode}: precision {cfg.dtype} ({why}); memory allocator "
           f"{allocator_in_use()}{hint}; model {cfg.model}; "
           f"task {cfg.task} ({cfg.train_size} training + {cfg.eval_size} held-out tasks)")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # measured once per machine, before any process uses it
        device = "cuda" if gpu_count() else "cpu"
        units = job_units(device)
        peak = unit_peak(device, cfg.dtype) * units
        print0(f"nanorft: MFU is measured against {peak / 1e12:.3g} TFLOP/s, " + (
            f"the nominal {cfg.dtype} peak of {units} GPU(s)" if device == "cuda" else
            f"{cfg.dtype} matrix products measured on {units} core(s) (once per CPU, cached in {models.cache_dir()})"))
    model_path = models.resolve_model(cfg.model) if rank == 0 else None
    tasks = workflows.prepare_tasks(cfg)
    tok = AutoTokenizer.from_pretrained(model_path) if rank == 0 else None  # loaded once for the checks below
    explorer.check_config(cfg, tok, tasks[2])
    if rank == 0:
        workflows.check_offline_data(cfg, tok)
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        alone = cfg.mode == "both" or bool(cfg.train_data)  # a run dir of its own (offline train: no explorers)
        if alone and not cfg.resume and run_dir.exists() and any(run_dir.iterdir()):
            if not cfg.overwrite:
                raise FileExistsError(f"run_dir {run_dir} is not empty (use --overwrite, --resume or another --run-dir)")
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.mode != "bench":
            buffer.check_config(cfg)
        # the fully asynchronous launches share the run dir: each side writes a file of its own (bench too)
        name = "config.json" if alone else f"config_{cfg.mode}.json"
        (run_dir / name).write_text(json.dumps({**dataclasses.asdict(cfg), "placement": dataclasses.asdict(layout),
                                                "precision": why},
                                               indent=2))
    return model_path, tasks


# what mode bench on a run directory takes from the run's saved config (bench_run_settings)
RUN_TASK_SETTINGS = ("task", "task_kwargs", "system_prompt", "reward_fn", "reward_kwargs", "workflow", "eval_size",
                     "seed", "max_tokens")


def bench_run_settings(cfg: Config) -> None:
    """Mode bench on a run directory (no --bench-models: it evaluates RUN_DIR/final): set
    each of RUN_TASK_SETTINGS that was not given in --config or by flag (cfg.given) to the
    run's own, from its saved config RUN_DIR/final/nanorft_config.json, else
    RUN_DIR/config.json (neither: nothing changes), and print one line naming them. With a
    task given that differs from the run's, task_kwargs and system_prompt stay the given
    task's. Raises ValueError (one line) for a saved config that cannot be read or holds a
    bad value."""
    if cfg.mode != "bench" or cfg.bench_models:
        return
    run_dir = Path(cfg.run_dir)
    src = next((p for p in (run_dir / "final" / "nanorft_config.json", run_dir / "config.json") if p.is_file()), None)
    if src is None:
        return
    try:
        saved = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{src}: not a saved config ({e})") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{src}: not a saved config (a JSON object)")
    same_task = "task" not in cfg.given or cfg.task == saved.get("task")
    types = {f.name: f.type for f in dataclasses.fields(Config)}
    taken = [name for name in RUN_TASK_SETTINGS if name in saved and name not in cfg.given
             and (same_task or name not in OTHER_TASK_DEFAULTS)]
    for name in taken:
        setattr(cfg, name, coerce(name, saved[name], types[name]))
    if taken:
        print(f"nanorft: mode bench on {run_dir / 'final'}: task {cfg.task}; {', '.join(taken)} from {src} "
              "(a flag or --config sets any of them)")


def bench(cfg: Config, tasks: tuple) -> None:
    """Mode bench: print a table of avg@k / pass@k per model on the held-out tasks of
    cfg.task (named in the table and in each row) and save RUN_DIR/bench.json."""
    from explorer import run_mode_bench
    from models import resolve_model

    models = [m.strip() for m in cfg.bench_models.split(",") if m.strip()] or [str(Path(cfg.run_dir) / "final")]
    paths = [resolve_model(m) for m in models]
    cfg.explorer_threads = cfg.explorer_threads or (os.cpu_count() or 1)
    print(f"nanorft: mode bench, task {cfg.task}, engine {cfg.engine}, {len(paths)} model(s), {cfg.bench_k} samples "
          "per task")
    out = Path(cfg.run_dir) / "bench.json"
    out.write_text(json.dumps(run_mode_bench(cfg, paths, tasks), indent=2))
    print(f"saved {out}")


def main(argv: list[str] | None = None) -> int:
    """Parse the config, validate inputs, run the mode; returns the exit code (2 with one
    error line for bad input). Appends the working directory to sys.path (plug-ins by
    import path)."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    # plug-ins by import path (--workflow mymod.MyWorkflow) from the working directory: sys.path[0] is run.py's
    # directory; the working directory goes last, so that it never shadows a module nanorft imports. Spawned
    # processes (the explorer) get this sys.path from multiprocessing.
    if not any(os.path.abspath(p or ".") == os.getcwd() for p in sys.path):
        sys.path.append(os.getcwd())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' loading bars would break the step bar
    try:
        cfg = parse_config(argv)
        if finished_run(cfg):
            print0(f"nanorft: the run in {cfg.run_dir} has finished (final weights in {Path(cfg.run_dir) / 'final'}): "
                   "nothing to resume")
            return 0
        bench_run_settings(cfg)  # mode bench on a run dir: its task, unless given
        model_path, tasks = prepare(cfg, rank)
        if cfg.mode == "bench":
            bench(cfg, tasks)
            return 0
    except (ValueError, OSError) as e:  # bad input: flags, files, directories
        print(f"run.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    sigints = []  # Ctrl-C seen: a library may wrap its KeyboardInterrupt (torch.distributed.checkpoint does)

    def on_sigint(*_):
        sigints.append(1)
        raise KeyboardInterrupt

    # Python's own Ctrl-C handler only (not in a thread, nor where SIGINT is ignored: a job started with nohup ... &)
    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    before = signal.signal(signal.SIGINT, on_sigint) if ours else None
    try:
        try:
            run(cfg, model_path, tasks)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a failed run: one line here, the traceback in RUN_DIR/error*.log; also
            # torch.distributed.checkpoint's CheckpointException, a BaseException
            if sigints:
                raise KeyboardInterrupt from e
            failed(cfg, rank, e)
            return 1
    except KeyboardInterrupt:
        if rank == 0:
            print(f"\nrun.py: interrupted; to continue: the same command with --resume (run dir {cfg.run_dir})",
                  file=sys.stderr)
        return 130
    finally:
        if ours:
            signal.signal(signal.SIGINT, before)
    return 0


def failed(cfg: Config, rank: int, e: BaseException) -> None:
    """A failed run: the traceback to RUN_DIR/error*.log, one line naming it on rank 0; then
    exit within EXIT_GRACE_S even if a thread hangs."""
    name = f"error_{cfg.explorer_name}.log" if cfg.mode == "explore" else f"error_rank{rank}.log" if rank else "error.log"
    log = Path(cfg.run_dir) / name
    try:
        log.write_text(traceback.format_exc())
    except OSError:
        log = "not saved"
    if rank == 0:
        print(f"run.py: error: {' '.join(str(e).split())} (traceback: {log})", file=sys.stderr)
    exit_within(EXIT_GRACE_S, log)


# a failed run's time to release its groups, stores and files on the way out (seconds; the tests shorten it)
EXIT_GRACE_S = float(os.environ.get("NANORFT_EXIT_GRACE_S", "60"))


def exit_within(seconds: float, log) -> None:
    """A failed run must not hang on its way out: the destructors of what it leaves behind
    (a weight-sync group with a broadcast pending to a peer that is gone) run after the
    error line. If the process is still alive `seconds` from now, the stacks of its threads
    are appended to `log` (the run's error log, else stderr) and it exits with code 1
    (faulthandler.dump_traceback_later)."""
    import faulthandler

    try:
        out = open(log, "a") if log != "not saved" else sys.stderr
    except OSError:
        out = sys.stderr
    faulthandler.dump_traceback_later(seconds, exit=True, file=out)


def run(cfg: Config, model_path: str, tasks: tuple) -> None:
    """Run mode explore, or start the trainer ranks (modes both and train) on `tasks` (prepare)."""
    if cfg.mode == "explore":
        from explorer import run_mode_explore

        split_threads(cfg, 1)
        print(f"nanorft: mode explore ({cfg.explorer_name}), engine {cfg.engine}, {cfg.explorer_threads} threads, "
              f"run dir {cfg.run_dir}")
        log = JsonlLog(Path(cfg.run_dir) / f"explorer_{cfg.explorer_name}.jsonl")
        try:
            run_mode_explore(cfg, model_path, tasks, log.write)
        finally:
            log.close()
        return
    import torch.distributed as dist

    from loop import run_trainer

    rank, world, device = init_distributed()
    shared = [model_path]
    dist.broadcast_object_list(shared, src=0)
    split_threads(cfg, world)
    layout = place(gpu_count(), world, cfg.mode)
    explorer = "no explorer" if cfg.mode == "train" else f"explorer: engine {cfg.engine} x {cfg.explorer_threads} threads"
    print0(f"nanorft: mode {cfg.mode}, {world} trainer rank(s) x {cfg.trainer_threads} threads, {explorer}, "
           f"model {shared[0]}, run dir {cfg.run_dir}\nplacement: {layout.describe()}")
    try:
        run_trainer(cfg, shared[0], rank, world, device, layout, tasks)
        dist.barrier()  # the ranks leave together: none tears the group down while rank 0 still finishes
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    preload_allocator(sys.argv[1:])
    sys.exit(main())
