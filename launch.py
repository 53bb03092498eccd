"""Process plumbing of every mode: where the processes run (devices, the weight-sync
transport), the memory allocator, the network interface of gloo, torch thread counts, and
how a run ends (Ctrl-C, a failure). run.py says what each mode starts; this module how.
"""
from __future__ import annotations

import ctypes.util
import os
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from config import Config, parse_config

def free_port() -> int:
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


def allocator_banner(cfg: Config, gpus: int) -> str:
    """The allocator this run uses, for the start banner, with a hint where a faster one is
    missing. Raises ValueError for --allocator tcmalloc without the library."""
    lib = tcmalloc(cfg)
    hint = "" if lib or cfg.allocator == "system" or gpus else (
        ": install libtcmalloc-minimal4 for a faster CPU trainer (--allocator)")
    return allocator_in_use() + hint


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
                          MASTER_PORT=str(free_port()))
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
    import ipaddress

    import sync
    from losses import resolve

    master = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("GLOO_SOCKET_IFNAME") or not master:
        return None
    try:
        address = sync.local_address(master)
    except OSError:  # no route to it: torch's own error names the address
        return None
    if ipaddress.ip_address(address).is_loopback:  # one host
        return None
    name = resolve("extras.hosts.interface_of", {}, "network interface lookup")(address)
    if name is not None:
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


def guarded(cfg: Config, rank: int, run) -> int:
    """Call `run()` and return the exit code: 0, 130 after Ctrl-C (one line saying how to
    resume), or 1 after a failure (`failed`: one line, the traceback in RUN_DIR)."""
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
            run()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # also torch.distributed.checkpoint's CheckpointException, a BaseException
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
