"""Weight sync, both ends: the schedule, the process group, the explorer's Receiver.

Schedule (Trinity-RFT semantics): explorer batch e (0-based) is generated with weight
version required_version(e) = k * floor(max(0, e - m) / k) for sync_interval k and
sync_offset m; the trainer's weights are version t + 1 after step t, published when
(t + 1) % k == 0 and after the last step. In flight (PipelineRL), rank 0 announces each
publish in its store before broadcasting it (`announced`).

Group: trainer rank 0 hosts a TCPStore; a gloo or NCCL group on PrefixStore("weights",
store), apart from the trainer's FSDP group, rank 0 = trainer, ranks 1.. = explorers. A
publish broadcasts the version, then the parameters in `named_parameters()` order (the
same on both ends), in buckets (`bucket_ranges`) cast to the wire dtype. With the
checkpoint method, checkpoints.py writes the weights and the Receiver loads the newest.
"""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from checkpoints import latest_checkpoint, load_latest_checkpoint


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
    """Resolve cfg.sync_method ("auto": broadcast in mode both, else checkpoint); ValueError
    for sync settings that cannot work in cfg.mode: broadcast between separate launches
    without --sync-port, --inflight outside the explorer, a max_staleness below what the
    schedule itself produces (sync_offset + sync_interval - 1)."""
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
    """The side that waits (the explorer for weights, the trainer for a batch) lends its CPU
    threads to the busy one. `flags`: a shared `Array("i", 2)` (trainer busy, explorer busy);
    `side` 0 (trainer rank 0) or 1 (explorer); `own` / `other`: the two sides' thread counts.
    `busy(flag)` marks this side; `apply()`, called before each micro-batch / decode step,
    sets this process's torch threads to own + other while the other side is idle, else own,
    and returns that count."""

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
    """Whether trainer rank 0 is alive, for a process that is not its child (mode explore,
    vLLM's worker): its weight-sync store still answers. A killed trainer's sockets close
    with it; a host that vanishes is noticed when TCP gives up. A store client of its own
    (a WeightSync's may be blocked in the rendezvous), connected here within `wait_s`
    seconds (the trainer may start later), else RuntimeError. One thread at a time."""

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


# how long a process waits for a trainer's store known to exist before it counts as gone
STORE_KNOWN_WAIT_S = 30.0


# elements a checksum sums at once: the float64 copy of them it makes takes 32 MiB
CHECKSUM_CHUNK = 2 ** 22


def checksum(tensors: Iterable[torch.Tensor]) -> float:
    """Float64 sum of all elements (--sync-checksum): equal weights give equal checksums.
    Summed CHECKSUM_CHUNK elements at a time: a float64 sum casts the whole tensor first
    (ATen's make_reduction), GiBs of GPU memory for an embedding."""
    return float(sum(c.sum(dtype=torch.float64) for t in tensors for c in t.detach().reshape(-1).split(CHECKSUM_CHUNK)))


def local_address(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent). Gloo's sockets
    bind to it: the default, the address of this machine's hostname, is often loopback."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def gpu_id(device: torch.device) -> str:
    """The UUID of a CUDA device (the same in every process that sees the GPU, whatever
    number CUDA_VISIBLE_DEVICES gives it there); "" for the CPU."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def group_backend(gpus: list[str]) -> str:
    """The weight-sync group's backend for ranks on `gpus` (`gpu_id` of each, rank order):
    "nccl" when every rank has a GPU of its own, else "gloo" through host memory: NCCL
    refuses two ranks of one group on one device (TRL compares the same UUIDs:
    trl/scripts/vllm_serve.py:83-93 @ f2cd577)."""
    return "nccl" if all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


class WeightSync:
    """One end of the weight-sync group.

    Rank 0 (the trainer: `rank` 0, `world_size` = 1 + the receivers) creates the TCPStore on
    `host`:`port` (0 = a free one: read `.port`); a receiver (`rank` None) takes the next
    free rank in `connect()`, so explorers started separately need only the address. After
    `connect()`, `device` is where the wire tensors live (the CPU when the group is gloo)
    and `wire_dtype` the dtype rank 0 announced. `device` "cuda": this thread's current GPU.
    `timeout_s` bounds every collective. `checksum` (rank 0): `send` returns a checksum.
    """

    def __init__(self, rank: int | None, world_size: int | None = None, port: int = 0, host: str = "127.0.0.1",
                 device: str = "cpu", timeout_s: float = 3600.0, bucket_elems: int = 0,
                 wire_dtype: torch.dtype = torch.float32, checksum: bool = False):
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
        self.group, self._pending, self.checksum = None, None, checksum
        # rank >= 1 on CPU: the receive buffer, kept (a fresh one page-faults on every publish)
        self._flat: torch.Tensor | None = None

    def connect(self, alive: Callable[[], bool] = lambda: True) -> "WeightSync":
        """Join (a receiver: `_join`; rank 0: `_announce`) and build the process group; blocks
        until every rank has called it, in a thread while this one polls `alive()`. Raises
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
        """A receiver: reach rank 0's store, take the next rank, declare this rank's GPU and dtype."""
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
        created now, not lazily at the first broadcast, where no `alive()` is watched (as
        torch/distributed/_dist2.py `_nccl_factory` does); or gloo, whose constructor
        connects every pair."""
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
        """Rank >= 1: this receiver will not touch the store again (`wait_left`). Raises
        nothing when the store is gone: the error that ended the explorer is reported."""
        try:
            self.store.add("left", 1)
        except dist.DistError:
            pass

    def wait_left(self, timeout_s: float) -> bool:
        """Rank 0: wait until every receiver has called `leave`; False after `timeout_s` seconds."""
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
        """Finish the broadcasts in flight, if any. RuntimeError when a peer went away."""
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

    def send(self, version: int, buckets: Iterable[list[torch.Tensor]],
             alive: Callable[[], bool] = lambda: True) -> float | None:
        """Rank 0: publish `buckets` (lists of full tensors in `named_parameters()` order, in
        any grouping: each is cut again by `bucket_ranges`, as the receivers cut) as
        `version`, cast to the wire dtype. Returns once the previous publish has completed
        and this one is in flight; bucketed, once every receiver has taken every bucket
        (`buckets` may gather lazily). Returns the checksum of what was sent if
        `self.checksum`, else None."""
        self.wait(alive)
        self.store.set("published", str(version))
        self._pending = [self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))]
        digest = 0.0 if self.checksum else None
        for given in buckets:
            for r in bucket_ranges([t.numel() for t in given], self.bucket_elems):
                flat = torch.cat([given[i].detach().reshape(-1).to(self.device, self.wire_dtype)
                                  for i in r])  # [bucket]
                self._pending.append(self._broadcast(flat))
                if self.checksum:
                    digest += checksum([flat])  # while it is on its way (read only)
                if self.bucket_elems:
                    self.wait(alive)
        return digest

    def announced(self) -> int:
        """Rank >= 1: the newest version rank 0 has started to publish (-1 before any);
        never blocks. RuntimeError when the store no longer answers (the trainer is gone)."""
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
    """The explorer's end: takes the trainer's published weights into `engine`
    (engines.Engine) and logs each receipt through `log` ("explorer/received_version",
    "time/explorer_wait_sync_s", and "sync/explorer_checksum" when the engine computes it).

    By broadcast over the weight-sync group whose store is at `host`:`port`, or, with port
    None, from the checkpoints in `run_dir`, loaded under `name`'s lease. `alive()` turns
    False when the trainer has died: a blocking receive then raises RuntimeError."""

    def __init__(self, engine, run_dir: str | Path, name: str, log: Callable[[dict], None],
                 alive: Callable[[], bool], port: int | None = None, timeout_s: float = 600.0, device: str = "cpu",
                 host: str = "127.0.0.1"):
        self.engine, self.run_dir, self.name, self.log, self.alive = engine, run_dir, name, log, alive
        self.port, self.timeout_s, self.device, self.host = port, timeout_s, device, host

    @classmethod
    def for_config(cls, cfg, engine, log: Callable[[dict], None], alive: Callable[[], bool], port: int,
                   device: str) -> "Receiver":
        """The Receiver of explorer cfg.explorer_name: by broadcast to `device` over the group
        at cfg.sync_host:`port` when cfg.sync_method is "broadcast", else from checkpoints."""
        return cls(engine, cfg.run_dir, cfg.explorer_name, log, alive,
                   port if cfg.sync_method == "broadcast" else None, cfg.sync_timeout_s, device, cfg.sync_host)

    def join(self) -> None:
        """Broadcast: join the weight-sync group on `device`; blocks until every rank is there."""
        if self.port is not None:
            self.engine.join_weight_sync(self.host, self.port, self.timeout_s, self.alive, self.device)

    def leave(self) -> None:
        """Broadcast: tell the trainer this explorer is done with the group (it waits for all)."""
        if self.port is not None and self.engine.weights_joined():
            self.engine.leave_weight_sync()

    def catch_up(self) -> None:
        """Take every publish announced so far (broadcast: each, in order; checkpoint: the newest)."""
        if self.port is None:
            self.poll()
        while self.port is not None and self.newest() > self.engine.version:
            self.receive()

    def newest(self) -> int:
        """The newest version the trainer has published or started to publish (-1: none)."""
        if self.port is not None:
            return self.engine.weights_announced()
        latest = latest_checkpoint(self.run_dir)
        return latest[0] if latest else -1

    def receive(self) -> None:
        """Block until the next version is loaded (broadcast: the next publish; checkpoint:
        a checkpoint newer than the engine's weights), polling `alive()`. Broadcast: the
        receive is posted only once that publish is announced (an NCCL receive posted early
        counts against the group's timeout while the trainer still trains)."""
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
        """Load the newest checkpoint if it is newer than the engine's weights; never waits."""
        t0 = time.perf_counter()
        if (got := self._load_newer()) is not None:
            self._logged(t0, got[1])

    def until(self, version: int) -> None:
        """Receive until the engine holds at least `version`."""
        while self.engine.version < version:
            self.receive()

    def _load_newer(self) -> tuple[int, float | None] | None:
        return load_latest_checkpoint(self.run_dir, self.name, self.engine.load_checkpoint, self.engine.version)

    def _logged(self, t0: float, digest: float | None) -> None:
        record = {"explorer/received_version": self.engine.version, "time/explorer_wait_sync_s": time.perf_counter() - t0}
        self.log(record if digest is None else {**record, "sync/explorer_checksum": digest})
