"""Weight-sync protocol shared by both ends: the schedule and the process group.

This file exists because the trainer (sender) and the explorer (receiver) must agree on
exactly the same schedule and wire format; keeping both halves in one place makes that
agreement visible and testable.

Schedule (Trinity-RFT semantics). Explorer batch e (0-based) is generated with weight
version  required_version(e) = k * floor(max(0, e - m) / k)  for sync_interval k and
sync_offset m. The trainer consumes batch t at step t; after step t its weights are
version t + 1, and it publishes them when (t + 1) % k == 0, and after the last step.

In-flight updates (PipelineRL): rank 0 announces each publish in the store (key
"published") before broadcasting it, so an explorer can check between two decode steps,
without blocking, whether new weights are on the way (`announced`).

Checkpoint method (fully asynchronous mode, separate launches): checkpoints.py writes and
reads the checkpoints; the Receiver here loads the newest one.

Group. Trainer rank 0 hosts a TCPStore; a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL`
(CUDA) is built directly on a PrefixStore("weights", store), separate from the trainer's
FSDP group. Rank 0 = trainer, ranks 1.. = explorers. Joining: each receiver declares the
dtype it holds and its GPU; rank 0 then announces the wire dtype (the receivers' dtype,
float32 when they differ: bf16 to a bf16 vLLM) and the backend (NCCL, or gloo through
host memory when two ranks share a GPU: `group_backend`). One publish = broadcast of the
version (int64 [1]) then of the parameters in `named_parameters()` order (identical on
both ends: same architecture), flattened into buckets (`bucket_ranges`: consecutive
parameters of at most `bucket_elems` elements; 0 = one bucket for all) and cast to the
wire dtype. Unbucketed, rank 0 copies everything into one buffer and goes on while it is
sent (a full copy of the model at the wire dtype); bucketed, it sends one bucket at a time
and waits until every receiver has taken it (O(bucket) memory, the trainer waits for the
explorers). A process that is not the trainer's child knows the trainer is alive by its
store answering (`StoreAlive`).
"""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch
import torch.distributed as dist

from checkpoints import latest_checkpoint, load_latest_checkpoint

T = TypeVar("T")


def required_version(batch: int, sync_interval: int, sync_offset: int) -> int:
    """Weight version explorer batch `batch` must be generated with (see module doc)."""
    return sync_interval * (max(0, batch - sync_offset) // sync_interval)


def publishes_after(step: int, sync_interval: int, total_steps: int) -> bool:
    """True if the trainer publishes weights (version step + 1) after 0-based `step`."""
    return (step + 1) % sync_interval == 0 or step == total_steps - 1


def published_versions(total_steps: int, sync_interval: int) -> list[int]:
    """All versions the trainer publishes in a run of `total_steps`, in order."""
    return [t + 1 for t in range(total_steps) if publishes_after(t, sync_interval, total_steps)]


def check_config(cfg) -> None:
    """Resolve cfg.sync_method ("auto": broadcast in mode both, else checkpoint) and raise
    ValueError (one line) for sync settings that cannot work in cfg.mode: broadcast
    between separate launches without --sync-port, --inflight outside the explorer, a
    max_staleness below what the schedule itself produces (sync_offset + sync_interval - 1)."""
    if cfg.sync_method == "auto":
        cfg.sync_method = "broadcast" if cfg.mode == "both" else "checkpoint"
    if cfg.mode in ("explore", "train") and cfg.sync_method == "broadcast" and not cfg.sync_port:
        raise ValueError(f"mode {cfg.mode} with --sync-method broadcast needs --sync-port (the same on trainer and "
                         "explorers) and, across hosts, --sync-host (the trainer host's address)")
    if cfg.inflight and cfg.mode not in ("both", "explore"):
        raise ValueError("--inflight is a setting of the explorer (mode both or explore)")
    bound = cfg.sync_offset + cfg.sync_interval - 1
    if cfg.mode == "both" and 0 <= cfg.max_staleness < bound:
        raise ValueError(f"max_staleness {cfg.max_staleness} < sync_offset + sync_interval - 1 = {bound}: "
                         "in mode both the schedule itself produces experiences that old")
    if cfg.max_staleness < -1:
        raise ValueError(f"max_staleness must be >= 0, or -1 for no bound, got {cfg.max_staleness}")


class CoreShare:
    """The schedule leaves one side idle at times (the explorer waiting for weights, the
    trainer waiting for a batch); the idle side lends its CPU threads to the busy one.

    `flags` is a shared array of two ints (torch.multiprocessing `Array("i", 2)`: trainer
    busy, explorer busy), `side` 0 (trainer rank 0) or 1 (explorer), `own` / `other` the
    thread counts of the two sides. `busy(flag)` marks this side; `apply()` sets this
    process's torch threads to own + other while the other side is idle, else own. Both
    sides call `apply()` before each unit of work (a micro-batch, a decode step), so a
    borrowed core goes back within one unit once its owner is busy again. Returns the
    thread count it set."""

    def __init__(self, flags, side: int, own: int, other: int):
        self.flags, self.side, self.own, self.other = flags, side, own, other

    def busy(self, flag: bool) -> None:
        self.flags[self.side] = int(flag)

    def apply(self) -> int:
        n = self.own if self.flags[1 - self.side] else self.own + self.other
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n


class StoreAlive:
    """Whether trainer rank 0 is alive, as a process that is not its child sees it: the
    weight-sync store it serves (WeightSync rank 0) still answers. The `alive()` of an
    explorer of another launch (mode explore) and of vLLM's worker process, which cannot
    watch a parent. A killed trainer's sockets close with it: the next call returns False
    (within milliseconds). A trainer host that vanishes without closing them is noticed only
    when TCP gives up on the connection.

    It holds a store client of its own (a WeightSync's may be blocked in the group's
    rendezvous meanwhile), connected here, retrying for up to `wait_s` seconds: the trainer
    of another launch may start later. Raises RuntimeError (one line) when no store answered
    by then. Call it from one thread at a time."""

    def __init__(self, host: str, port: int, wait_s: float):
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s))
        except dist.DistError:
            raise RuntimeError(f"weight sync: no trainer answered at {host}:{port} within {wait_s:.0f} s (is it "
                               "running, with the same --sync-host/--sync-port?)") from None

    def __call__(self) -> bool:
        try:
            return self.store.check(["world"])
        except dist.DistError:  # "Connection was likely closed", "Broken pipe": the store is gone
            return False


# How long a process waits for a trainer's store that is known to exist (mode both: started
# before the explorer; mode explore: the explorer process has reached it) before it counts as gone
STORE_KNOWN_WAIT_S = 30.0


# elements a checksum sums at once: the float64 copy of them it makes takes 32 MiB
CHECKSUM_CHUNK = 2 ** 22


def checksum(tensors: Iterable[torch.Tensor]) -> float:
    """Float64 sum of all elements: equal weights give equal checksums (for metrics and tests).
    Summed CHECKSUM_CHUNK elements at a time: a float64 sum of a float32/bf16 tensor casts
    it first, `sum(dtype=torch.float64)` too (ATen's make_reduction: `self.to(in_dtype)`),
    and a whole embedding's float64 copy takes GiBs of GPU memory."""
    return float(sum(c.sum(dtype=torch.float64) for t in tensors for c in t.detach().reshape(-1).split(CHECKSUM_CHUNK)))


def local_address(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent). Gloo's sockets
    bind to it: the default, the address of this machine's hostname, is often loopback."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 `address` (e.g.
    "eth0"; "lo" for 127.0.0.1), or None when none does (or `address` is not IPv4). Gloo
    binds the interface that GLOO_SOCKET_IFNAME names (launch.init_distributed)."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(got) == address:
            return name
    return None


def gpu_id(device: torch.device) -> str:
    """The UUID of a CUDA device (the same in every process that sees the GPU, whatever
    number CUDA_VISIBLE_DEVICES gives it there); "" for the CPU."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def group_backend(gpus: list[str]) -> str:
    """The weight-sync group's backend for ranks on `gpus` (`gpu_id` of each, rank order):
    "nccl" when every rank has a GPU of its own, else "gloo" through host memory. NCCL
    refuses two ranks of one group on one device ("ncclInvalidUsage: Duplicate GPU
    detected"): an explorer of another launch on trainer rank 0's GPU gets host staging, as
    in mode both's colocated layout. TRL compares the same UUIDs and refuses such a client
    (trl/scripts/vllm_serve.py:83-93 @ f2cd577)."""
    return "nccl" if all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


class WeightSync:
    """One end of the weight-sync group.

    Rank 0 (the trainer: `rank` 0, `world_size` = 1 + the number of receivers) creates the
    TCPStore on `host`:`port` (0 = pick a free one, then read `.port`) and records the world
    size and the group's device type there. A receiver (`rank` None) connects to that store
    in `connect()` and takes the next free rank, so explorers started separately (--mode
    explore, other hosts) need only the address. `connect()` blocks until every rank has
    called it and the group is built (NCCL's communicator included); afterwards `device` is
    where the wire tensors live (the CPU when the group fell back to gloo) and `wire_dtype`
    the dtype rank 0 announced. `device` "cuda" means this thread's current GPU.
    `timeout_s` bounds every collective. Raises RuntimeError if `alive()` turns False while
    waiting (the peer died, even before its store was reached), so no side hangs forever,
    and for a receiver more than the trainer expects.
    """

    def __init__(self, rank: int | None, world_size: int | None = None, port: int = 0, host: str = "127.0.0.1",
                 device: str = "cpu", timeout_s: float = 3600.0, bucket_elems: int = 0,
                 wire_dtype: torch.dtype = torch.float32):
        self.rank, self.world_size, self.device, self.host = rank, world_size, torch.device(device), host
        if self.device.type == "cuda" and self.device.index is None:  # the group's thread has a current GPU of its own
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout, self.bucket_elems, self.wire_dtype = timedelta(seconds=timeout_s), bucket_elems, wire_dtype
        self.store = None
        if rank == 0:
            self.store = dist.TCPStore(host, port, world_size, is_master=True, timeout=self.timeout,
                                       wait_for_workers=False)
            self.store.set("world", str(world_size))
            self.store.set("device", self.device.type)
            self.store.set("bucket_elems", str(bucket_elems))
            self.store.set("gpu/0", gpu_id(self.device))
        self.port = self.store.port if self.store is not None else port
        self.group, self._pending = None, None
        # rank >= 1 on CPU: the receive buffer (one bucket's size), kept between publishes (a
        # fresh host allocation of the model's size page-faults on every publish: ~2x slower sync)
        self._flat: torch.Tensor | None = None

    def connect(self, alive: Callable[[], bool] = lambda: True) -> "WeightSync":
        """Join (a receiver: `_join`; rank 0: `_announce`) and build the process group; blocks
        until every rank has called it (rank 0 calls it after starting the explorers it passed
        `.port` to). Every wait of it runs in a thread while this one polls `alive()`: raises
        RuntimeError if `alive()` turns False meanwhile, or when the group is full."""
        done: list = []  # the group, or the exception that building it raised

        def build():
            try:
                if self.store is None:
                    self._join()
                else:
                    self._announce()
                self.wire_dtype = getattr(torch, self.store.get("wire_dtype").decode())
                if self.store.get("backend").decode() == "gloo":
                    self.device = torch.device("cpu")  # staged through host memory
                done.append(self._group())
            except Exception as e:  # reported by connect(), not lost in the thread
                done.append(e)

        builder = threading.Thread(target=build, daemon=True)
        builder.start()
        while builder.is_alive():
            if not alive():
                raise RuntimeError("weight sync: the peer process died before joining the group")
            builder.join(0.05)
        if isinstance(done[0], Exception):
            raise RuntimeError(f"weight sync: building the process group failed: {done[0]}")
        self.group = done[0]
        return self

    def _join(self) -> None:
        """A receiver: reach rank 0's store (retrying until the timeout), take the next rank,
        check the group's device type and declare this rank's GPU and dtype."""
        self.store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)
        self.world_size = int(self.store.get("world"))
        self.rank = self.store.add("joined", 1)
        if self.rank >= self.world_size:
            raise RuntimeError(f"the trainer expects {self.world_size - 1} explorer(s) (--num-explorers) "
                               "and all have joined")
        if self.store.get("device").decode() != self.device.type:
            raise RuntimeError(f"the trainer syncs on {self.store.get('device').decode()}, this explorer "
                               f"on {self.device.type}")
        self.bucket_elems = int(self.store.get("bucket_elems"))
        self.store.set(f"gpu/{self.rank}", gpu_id(self.device))
        self.store.set(f"wire_dtype/{self.rank}", str(self.wire_dtype).removeprefix("torch."))  # declared last

    def _announce(self) -> None:
        """Rank 0, once every receiver has declared itself: the wire dtype (theirs, float32
        when they differ) and the backend (`group_backend`), for every rank to read."""
        receivers = range(1, self.world_size)
        self.store.wait([f"wire_dtype/{r}" for r in receivers])
        names = {self.store.get(f"wire_dtype/{r}").decode() for r in receivers}
        self.store.set("wire_dtype", names.pop() if len(names) == 1 else "float32")
        self.store.set("backend", group_backend([self.store.get(f"gpu/{r}").decode() for r in range(self.world_size)]))

    def _group(self):
        """The process group on a PrefixStore("weights", store): NCCL with its communicator
        created now (ncclCommInitRank is otherwise lazy: it would run at the first broadcast,
        on the main thread, where no `alive()` is watched), as torch's own NCCL factory does
        (torch/distributed/_dist2.py `_nccl_factory`) and TRL's async weight transfer
        (trl/experimental/async_grpo/weight_transfer.py:48-74 @ f2cd577); or gloo, whose
        constructor connects every pair."""
        prefixed = dist.PrefixStore("weights", self.store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            group = dist.ProcessGroupNCCL(prefixed, self.rank, self.world_size, opts)
            group.eager_connect_single_device(self.device)
            return group
        # gloo's sockets on the address that reaches rank 0's store, not the hostname's (loopback?)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(self.host))]
        return dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, opts)

    def leave(self) -> None:
        """Rank >= 1: this receiver will not touch the store again (`wait_left`). A store
        that is gone (its trainer died) needs no goodbye: nothing is raised then, so the
        error that ended the explorer is the one reported."""
        try:
            self.store.add("left", 1)
        except dist.DistError:
            pass

    def wait_left(self, timeout_s: float) -> bool:
        """Rank 0: wait until every receiver has called `leave` (the store goes with this
        process); False after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while self.store.add("left", 0) < self.world_size - 1:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _broadcast(self, t: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([t], opts)

    def wait(self, alive: Callable[[], bool] = lambda: True, poll_s: float = 0.01) -> None:
        """Finish the broadcasts in flight, if any. RuntimeError (one line) when a peer
        went away meanwhile: gloo's message, which names its address, after who it was."""
        while self._pending:
            work = self._pending[0]
            if work.is_completed():
                try:
                    work.wait()
                except RuntimeError as e:  # gloo: "Connection closed by peer [ADDR]:PORT", "Read error ..."
                    who = "an explorer" if self.rank == 0 else f"the trainer at {self.host}:{self.port}"
                    raise RuntimeError(f"weight sync: a publish broke off, {who} went away "
                                       f"({' '.join(str(e).split())})") from None
                self._pending.pop(0)
            elif not alive():
                raise RuntimeError("weight sync: the peer process died during a broadcast")
            else:
                time.sleep(poll_s)

    def send(self, version: int, buckets: Iterable[list[torch.Tensor]], alive: Callable[[], bool] = lambda: True) -> float:
        """Rank 0: publish `buckets` (lists of full tensors in `named_parameters()` order:
        the cut of `bucket_ranges` with this group's bucket_elems, or one list of all) as
        `version`, cast to the wire dtype. Each list is cut again by `bucket_ranges`, so the
        wire holds the receivers' cut however the caller grouped the tensors (a resumed
        trainer's first publish passes one list of all; bucketed receivers then aborted in
        gloo: "Received data size doesn't match expected size"). Returns the checksum of
        what was sent, once the previous publish has completed and this one is in flight
        (its data copied first); bucketed, once every receiver has taken every bucket (a
        bucket is built only when the previous one is taken: `buckets` may gather lazily)."""
        self.wait(alive)
        self.store.set("published", str(version))
        self._pending = [self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))]
        digest = 0.0
        for given in buckets:
            for r in bucket_ranges([t.numel() for t in given], self.bucket_elems):
                flat = torch.cat([given[i].detach().reshape(-1).to(self.device, self.wire_dtype)
                                  for i in r])  # [bucket]
                self._pending.append(self._broadcast(flat))
                digest += checksum([flat])  # while it is on its way (read only)
                if self.bucket_elems:
                    self.wait(alive)
        return digest

    def announced(self) -> int:
        """Rank >= 1: the newest version rank 0 has started to publish (-1 before any);
        never blocks. RuntimeError (one line naming the store's address) when the store no
        longer answers: the trainer rank 0 that hosted it is gone."""
        try:
            return int(self.store.get("published")) if self.store.check(["published"]) else -1
        except dist.DistError as e:
            raise RuntimeError(f"weight sync: the trainer's store at {self.host}:{self.port} stopped answering (the "
                               f"trainer is gone: {' '.join(str(e).split())})") from None

    def recv(self, params: list[torch.Tensor], alive: Callable[[], bool] = lambda: True) -> int:
        """Rank >= 1: receive the next publish into `params` in place, bucket by bucket
        through one buffer of the largest bucket's size (wire dtype); returns its version."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._pending = [self._broadcast(version)]
        ranges = bucket_ranges([p.numel() for p in params], self.bucket_elems)
        need = max(sum(params[i].numel() for i in r) for r in ranges)
        if self._flat is None or self._flat.numel() != need or self._flat.dtype != self.wire_dtype:
            self._flat = torch.empty(need, dtype=self.wire_dtype, device=self.device)
        buffer = self._flat
        if self.device.type != "cpu":  # CUDA's caching allocator reuses the memory anyway: hold none between publishes
            self._flat = None
        for r in ranges:
            ps = [params[i] for i in r]
            flat = buffer[:sum(p.numel() for p in ps)]  # [bucket]
            self._pending.append(self._broadcast(flat))
            self.wait(alive)
            _unflatten(flat, ps)
        return int(version.item())


def bucket_ranges(numels: list[int], limit: int) -> list[range]:
    """Cut tensors of `numels` elements into consecutive index ranges of at most `limit`
    elements each (a tensor larger than `limit` is a range of its own; `limit` 0: one
    range for all). Both ends of a publish cut the same way."""
    if limit <= 0 or not numels:
        return [range(len(numels))]
    out, start, size = [], 0, 0
    for i, n in enumerate(numels):
        if i > start and size + n > limit:
            out.append(range(start, i))
            start, size = i, 0
        size += n
    out.append(range(start, len(numels)))
    return out


@torch.no_grad()
def _unflatten(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


class Receiver:
    """The explorer's end of the protocol: takes the trainer's published weights into
    `engine` (engines.Engine: join_weight_sync, receive_weights, weights_announced,
    load_checkpoint, version) and logs each receipt as {"explorer/received_version",
    "time/explorer_wait_sync_s", "sync/explorer_checksum"} through `log`.

    By broadcast over the weight-sync group whose store is at `host`:`port` (mode both; mode
    explore with --sync-method broadcast), or, with port None, from the checkpoints in
    `run_dir` (mode explore, and --sync-method checkpoint), loaded under `name`'s lease.
    `alive()` turns False when the trainer has died: a blocking receive then raises
    RuntimeError instead of waiting."""

    def __init__(self, engine, run_dir: str | Path, name: str, log: Callable[[dict], None],
                 alive: Callable[[], bool], port: int | None = None, timeout_s: float = 600.0, device: str = "cpu",
                 host: str = "127.0.0.1"):
        self.engine, self.run_dir, self.name, self.log, self.alive = engine, run_dir, name, log, alive
        self.port, self.timeout_s, self.device, self.host = port, timeout_s, device, host

    def join(self) -> None:
        """Broadcast: join the weight-sync group as the next receiving rank on `device`
        ("cuda": NCCL, "cpu": gloo), blocking until the trainer and every other explorer are there."""
        if self.port is not None:
            self.engine.join_weight_sync(self.host, self.port, self.timeout_s, self.alive, self.device)

    def leave(self) -> None:
        """Broadcast: tell the trainer this explorer is done with the group (it waits for all)."""
        if self.port is not None and self.engine.weights_joined():
            self.engine.leave_weight_sync()

    def catch_up(self) -> None:
        """Take every publish announced so far (broadcast: each one, in order, as every
        receiver must; checkpoint: the newest); never waits for one that is not announced."""
        if self.port is None:
            self.poll()
        while self.port is not None and self.newest() > self.engine.version:
            self.receive()

    def newest(self) -> int:
        """The newest version the trainer has published or started to publish (-1: none);
        never blocks."""
        if self.port is not None:
            return self.engine.weights_announced()
        latest = latest_checkpoint(self.run_dir)
        return latest[0] if latest else -1

    def receive(self) -> None:
        """Block until the next version is loaded (broadcast: the next publish; checkpoint:
        a checkpoint newer than the engine's weights). Broadcast: the receive is posted only
        once that publish is announced (an NCCL receive posted early counts against the
        group's timeout while the trainer still trains, and its watchdog then kills the
        process); until then `alive()` is polled."""
        t0 = time.perf_counter()
        if self.port is not None:
            while self.newest() <= self.engine.version:
                self._check_alive()
                time.sleep(0.05)
            _, digest = self.engine.receive_weights(self.alive)
        else:
            while (got := self._load_newer()) is None:
                self._check_alive()
                time.sleep(0.05)
            digest = got[1]
        self._logged(t0, digest)

    def _check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError("explorer: the trainer died")

    def poll(self) -> None:
        """Load the newest checkpoint if it is newer than the engine's weights (never waits
        for one)."""
        t0 = time.perf_counter()
        if (got := self._load_newer()) is not None:
            self._logged(t0, got[1])

    def until(self, version: int) -> None:
        """Receive until the engine holds at least `version`."""
        while self.engine.version < version:
            self.receive()

    def _load_newer(self) -> tuple[int, float] | None:
        return load_latest_checkpoint(self.run_dir, self.name, self.engine.load_checkpoint, self.engine.version)

    def _logged(self, t0: float, digest: float) -> None:
        self.log({"explorer/received_version": self.engine.version, "time/explorer_wait_sync_s": time.perf_counter() - t0,
                  "sync/explorer_checksum": digest})
