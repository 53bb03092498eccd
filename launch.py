"""Process plumbing: device placement (`place`), allocator, gloo's interface, threads, how a run
ends (`guarded`)."""

import ctypes.util
import importlib.metadata
import ipaddress
import os
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

import sync
from config import Config, parse_config

# a failed run's time to release its groups, stores and files on the way out (seconds; the tests
# shorten it)
EXIT_GRACE_S = float(os.environ.get("NANORFT_EXIT_GRACE_S", "60"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """Each trainer rank's device, the explorer's, whether it shares rank 0's GPU, and the
    weight-sync device type."""

    trainer: tuple[str, ...]
    explorer: str
    colocated: bool
    sync_device: str
    unused_gpus: int = 0

    def describe(self, sync_method: str = "broadcast") -> str:
        where = f"trainer on {', '.join(self.trainer)}"
        if self.explorer:
            where += f"; explorer on {self.explorer}"
            if self.colocated:
                where += " (colocated with trainer rank 0)"
            how = "NCCL" if self.sync_device == "cuda" else "gloo"
            where += f"; weight sync {'ipc' if sync_method == 'ipc' else how}"
        if self.unused_gpus:
            where += f"; {self.unused_gpus} GPU(s) unused"
        return where


def place(gpus: int, ranks: int, mode: str) -> Placement:
    """Rank i on cuda:i, the explorer on the first free GPU, else on cuda:0. ValueError: fewer GPUs
    than ranks."""
    if gpus == 0:
        return Placement(("cpu",) * ranks, "cpu" if mode == "both" else "", False, "cpu")
    if ranks > gpus:
        raise ValueError(
            f"{ranks} trainer ranks need {ranks} GPUs, {gpus} visible "
            "(torchrun --nproc_per_node <= GPUs)"
        )
    trainer = tuple(f"cuda:{i}" for i in range(ranks))
    if mode != "both":
        return Placement(trainer, "", False, "cuda", gpus - ranks)
    if gpus == ranks:
        return Placement(trainer, "cuda:0", True, "cpu")
    return Placement(trainer, f"cuda:{ranks}", False, "cuda", gpus - ranks - 1)


def gpu_count() -> int:
    """Visible CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mimalloc() -> str | None:
    try:  # the cmeel-mimalloc wheel of requirements.txt
        lib = importlib.metadata.distribution("cmeel-mimalloc").locate_file(
            "cmeel.prefix/lib/libmimalloc.so"
        )
    except importlib.metadata.PackageNotFoundError:
        return None
    return str(lib) if Path(lib).is_file() else None


# preloaded allocators, the best first (benchmarks/allocators.py, docs/benchmarks.md): both keep
# freed pages for the next step, where glibc's malloc returns large blocks to the kernel and faults
# them in again
ALLOCATORS = {
    "tcmalloc": lambda: (
        ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    ),
    "mimalloc": _mimalloc,
}
INSTALL = {
    "mimalloc": "pip install cmeel-mimalloc",
    "tcmalloc": "apt-get install libtcmalloc-minimal4",
}
# mimalloc's transparent huge pages are faulted in 2 MiB at a time: they grow the trainer's
# RSS (docs/benchmarks.md)
ALLOCATOR_ENV = {"mimalloc": {"MIMALLOC_ALLOW_THP": "0"}}


def allocator_library(name: str) -> str | None:
    """The shared library of allocator `name` (a key of ALLOCATORS) where installed, else None."""
    return ALLOCATORS[name]() if sys.platform == "linux" else None


def allocator(cfg: Config) -> tuple[str, str | None]:
    """(name, library to preload) of the run's allocator. ValueError: an allocator asked for is not
    installed."""
    if cfg.allocator == "system" or (cfg.allocator == "auto" and gpu_count()):
        return "system", None
    for name in ALLOCATORS if cfg.allocator == "auto" else [cfg.allocator]:
        if lib := allocator_library(name):
            return name, lib
    if cfg.allocator != "auto":
        raise ValueError(f"--allocator {cfg.allocator}: not installed ({INSTALL[cfg.allocator]})")
    return "system", None


def allocator_banner(cfg: Config) -> str:
    """The allocator this process runs with, for the start banner (ValueError as `allocator`)."""
    name, lib = allocator(cfg)
    if lib and lib in os.environ.get("LD_PRELOAD", ""):
        return name
    malloc = "the C library's malloc"
    if cfg.allocator == "system" or gpu_count():
        return malloc
    return f"{malloc}: {INSTALL['mimalloc']} (requirements.txt) for a faster CPU trainer"


def preload_allocator(argv: list[str]) -> None:
    """Re-execute this process (same pid and arguments) with the chosen allocator in LD_PRELOAD."""
    if {"-h", "--help"} & set(argv):
        return
    try:
        name, lib = allocator(parse_config(argv))
    except (ValueError, OSError):
        return  # main reports it
    if lib and lib not in os.environ.get("LD_PRELOAD", ""):
        # the user's own settings win
        for key, value in ALLOCATOR_ENV.get(name, {}).items():
            os.environ.setdefault(key, value)
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [lib, os.environ.get("LD_PRELOAD", "")]))
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def init_distributed():
    """(rank, world_size, device) in the default (FSDP) group, from torchrun's env or as one
    rank."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    gloo_interface()  # on GPUs too: the gloo half of "cpu:gloo,cuda:nccl" binds as gloo alone would
    if not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timedelta(hours=1))
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    # gloo beside NCCL: a CPU tensor in a collective (a resume's checkpoint metadata, say) would
    # otherwise raise
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timedelta(hours=1))
    return dist.get_rank(), dist.get_world_size(), device


def gloo_interface() -> str | None:
    """Across hosts, set GLOO_SOCKET_IFNAME to the interface towards MASTER_ADDR; returns it, or
    None."""
    master = os.environ.get("MASTER_ADDR", "")
    one_host = master in ("", "127.0.0.1", "localhost")
    if os.environ.get("GLOO_SOCKET_IFNAME") or one_host:
        return None
    try:
        address = sync.local_address(master)
    except OSError:  # no route to it: torch's own error names the address
        return None
    # gloo would bind the hostname's address, often loopback (Debian: 127.0.1.1), where other
    # nodes cannot reach it
    if ipaddress.ip_address(address).is_loopback:  # one host
        return None
    if (name := interface_of(address)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address` (e.g. "eth0"), else
    None."""
    return next(
        (
            name
            for name, addrs in psutil.net_if_addrs().items()
            if any(a.address == address for a in addrs)
        ),
        None,
    )


def split_threads(cfg: Config, world: int) -> None:
    """Fill 0 thread counts: the explorer (none offline) and the `world` trainer ranks share the
    cores."""
    cores = os.cpu_count() or 1
    offline = cfg.mode == "train" and bool(cfg.train_data)
    if cfg.explorer_threads == 0:
        cfg.explorer_threads = max(1, cores // (world + 1))
    if cfg.trainer_threads == 0:
        cfg.trainer_threads = max(1, (cores - (0 if offline else cfg.explorer_threads)) // world)


def guarded(cfg: Config, rank: int, run, leave_on_interrupt: bool = False) -> int:
    """Call `run()`; the exit code: 0, 130 after Ctrl-C (one line on how to resume), 1 after a
    failure. `leave_on_interrupt`: the process ends after that line, before the finalizers of the
    interrupted step (a broadcast in flight) wait for a peer the interrupt stopped, as kill -9."""
    # Ctrl-C seen: a library may wrap its KeyboardInterrupt (torch.distributed.checkpoint does)
    sigints = []

    def on_sigint(*_):
        sigints.append(1)
        raise KeyboardInterrupt

    # Python's own Ctrl-C handler only (not in a thread, nor where SIGINT is ignored: a job started
    # with nohup ... &)
    ours = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    before = signal.signal(signal.SIGINT, on_sigint) if ours else None
    try:
        run()
    except SystemExit:
        raise
    # also torch.distributed.checkpoint's CheckpointException, a BaseException
    except BaseException as e:
        if not (sigints or isinstance(e, KeyboardInterrupt)):
            failed(cfg, rank, e)
            return 1
        if rank == 0:
            print(
                "\nrun.py: interrupted; to continue: the same command with --resume "
                f"(run dir {cfg.run_dir})",
                file=sys.stderr,
            )
        if leave_on_interrupt:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
    finally:
        if ours:
            signal.signal(signal.SIGINT, before)
    return 0


def failed(cfg: Config, rank: int, e: BaseException) -> None:
    """The traceback to RUN_DIR/error*.log, one line naming it; still alive EXIT_GRACE_S later, the
    process exits."""
    import faulthandler

    name = f"_{cfg.explorer_name}" if cfg.mode == "explore" else f"_rank{rank}" if rank else ""
    log = Path(cfg.run_dir) / f"error{name}.log"
    try:
        log.write_text(traceback.format_exc())
        out = open(log, "a")
    except OSError:
        log, out = "not saved", sys.stderr
    if rank == 0:
        print(f"run.py: error: {' '.join(str(e).split())} (traceback: {log})", file=sys.stderr)
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=out)


def exit_quietly(*_) -> None:
    """SIGTERM handler (the trainer failed and reported it): exit code 1, no second report."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.exit(1)
