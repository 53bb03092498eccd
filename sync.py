"""Weight sync, both ends: the torch.distributed group (`WeightSync`), the trainer's weight
publisher over it (`SentWeights`), the explorer's `Receiver`, and the order-sensitive digest of
--sync-checksum (`Checksum`). Other methods (CUDA IPC handles, checkpoints) keep these interfaces
and are handed over by the composition root; the schedule of publishes is schedule.py's."""

import contextlib
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist


def local_address(host: str) -> str:
    """This machine's address on the route to `host` (the hostname's is often loopback)."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def gpu_id(device: torch.device) -> str:
    """The UUID of a CUDA device (the same in every process); "" for the CPU."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def group_backend(gpus: list[str]) -> str:
    """ "nccl" when every rank (`gpu_id`s in rank order) has a GPU of its own, else "gloo" (as TRL's
    vllm_serve.py)."""
    return "nccl" if all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


class WeightSync:
    """One end of the weight-sync group: rank 0 hosts the store at `host`:`port`; `rank` None: the
    next free."""

    def __init__(
        self,
        rank: int | None,
        world_size: int | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
        device: str = "cpu",
        timeout_s: float = 3600.0,
        bucket_elems: int = 0,
        wire_dtype: torch.dtype = torch.float32,
        checksum: bool = False,
    ):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.host = host
        # the group's thread has a current GPU of its own
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout = timedelta(seconds=timeout_s)
        self.bucket_elems = bucket_elems
        self.wire_dtype = wire_dtype
        self.store = None
        self.group = None
        self._pending = None
        # publishes started (rank 0) or received (rank >= 1); rank 0's key of each: publish/N
        self.publishes = 0
        self.waiter = None  # wait_for's connection to the store
        # rank >= 1's receive buffer (CPU: kept)
        self._flat = None
        if rank == 0:
            self.store = dist.TCPStore(
                host, port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
            )
            self.store.set("world", str(world_size))
            self.store.set("device", self.device.type)
            self.store.set("bucket_elems", str(bucket_elems))
            self.store.set("gpu/0", gpu_id(self.device))
        self.port = self.store.port if self.store is not None else port
        self.checksum = checksum

    def connect(self, alive: Callable[[], bool] = lambda: True) -> "WeightSync":
        """Build the group once every rank has called it. RuntimeError if `alive()` turns False."""
        done: list = []  # the group, or the exception that building it raised

        def build():
            try:
                (self._join if self.store is None else self._announce)()  # a receiver / rank 0
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
        self.store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)
        self.world_size = int(self.store.get("world"))
        self.rank = self.store.add("joined", 1)
        if self.rank >= self.world_size:
            raise RuntimeError(
                f"the trainer expects {self.world_size - 1} explorer(s) (--num-explorers) and all "
                "have joined"
            )
        if self.store.get("device").decode() != self.device.type:
            raise RuntimeError(
                f"the trainer syncs on {self.store.get('device').decode()}, this explorer on "
                f"{self.device.type}"
            )
        self.bucket_elems = int(self.store.get("bucket_elems"))
        self.store.set(f"gpu/{self.rank}", gpu_id(self.device))
        # declared last
        self.store.set(f"wire_dtype/{self.rank}", str(self.wire_dtype).removeprefix("torch."))

    def _announce(self) -> None:
        receivers = range(1, self.world_size)
        self.store.wait([f"wire_dtype/{r}" for r in receivers])
        names = {self.store.get(f"wire_dtype/{r}").decode() for r in receivers}
        self.store.set("wire_dtype", names.pop() if len(names) == 1 else "float32")
        gpus = [self.store.get(f"gpu/{r}").decode() for r in range(self.world_size)]
        self.store.set("backend", group_backend(gpus))

    def _group(self):
        # NCCL: the communicator at once, not at the first broadcast where no `alive()` is watched
        # (as _dist2.py)
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
        """Rank >= 1: done with the store (a trainer of mode train waits for every explorer to
        leave)."""
        with contextlib.suppress(dist.DistError):
            self.store.add("left", 1)

    def wait_left(self, timeout_s: float) -> bool:
        """Rank 0: wait until every other rank has left (`leave`); False (a warning) after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.store.add("left", 0) < self.world_size - 1:
            if time.monotonic() > deadline:
                print(
                    "run.py: warning: not every explorer left the weight-sync group within "
                    f"{timeout_s:.0f} s",
                    file=sys.stderr,
                )
                return False
            time.sleep(0.05)
        return True

    def _broadcast(self, t: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([t], opts)

    def wait(self, alive: Callable[[], bool] = lambda: True, poll_s: float = 0.01) -> None:
        """Finish the broadcasts in flight. RuntimeError when a peer went away."""
        while self._pending:
            work = self._pending[0]
            if work.is_completed():
                try:
                    work.wait()
                # gloo: "Connection closed by peer [ADDR]:PORT", "Read error ..."
                except RuntimeError as e:
                    who = f"the trainer at {self.host}:{self.port}" if self.rank else "an explorer"
                    raise RuntimeError(
                        f"weight sync: a publish broke off, {who} went away "
                        f"({' '.join(str(e).split())})"
                    ) from None
                self._pending.pop(0)
            elif not alive():
                raise RuntimeError("weight sync: the peer process died during a broadcast")
            else:
                time.sleep(poll_s)

    def announce(self, version: int) -> None:
        """Rank 0: `version` is being published (`announced`, `wait_announced`)."""
        self.publishes += 1
        self.store.set("published", str(version))
        self.store.set(f"publish/{self.publishes}", str(version))

    def wait_for(
        self, keys: list[str], alive: Callable[[], bool], what: str, deadline: float | None = None
    ) -> None:
        """Block until `keys` are set in the store; RuntimeError (one line) once `alive()` is False,
        at `deadline` (time.monotonic(); default: --sync-timeout-s from now), or when the store is
        gone. The store's own wait runs in a thread, on a connection of its own (a wait holds its
        connection), so that `alive()` is watched meanwhile and the caller wakes as soon as the keys
        are set: no polling of the store."""
        deadline = deadline or time.monotonic() + self.timeout.total_seconds()
        peer = "an explorer" if self.rank == 0 else "the trainer"
        failed: list = []

        def block():
            try:
                left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
                self.waiter.wait(keys, left)
            except Exception as e:  # raised below, in the caller's thread
                failed.append(e)

        try:
            if self.store.check(keys):
                return
            # a wait past its deadline ends at once: a dead peer is said before it
            if not alive():
                raise RuntimeError(f"weight sync: {peer} died (waiting for {what})")
            if self.waiter is None:
                self.waiter = dist.TCPStore(
                    self.host, self.port, is_master=False, timeout=self.timeout
                )
            waiting = threading.Thread(target=block, daemon=True)
            waiting.start()
            while waiting.is_alive():
                if not alive():
                    self.waiter = None  # its thread still waits on it
                    raise RuntimeError(f"weight sync: {peer} died (waiting for {what})")
                waiting.join(0.05)
            if failed:
                raise failed[0]
        except dist.DistStoreError:
            raise RuntimeError(
                f"weight sync: no {what} within --sync-timeout-s {self.timeout.total_seconds():g} s"
            ) from None
        except dist.DistError as e:  # a receiver's store connection: rank 0 is gone
            store = f"{self.host}:{self.port}"
            reason = " ".join(str(e).split())
            raise RuntimeError(
                f"weight sync: the trainer's store at {store} stopped answering "
                f"(the trainer is gone: {reason})"
            ) from None

    def wait_announced(self, alive: Callable[[], bool]) -> None:
        """Rank >= 1: block until rank 0 starts the publish after the last one received (no time
        limit: the trainer steps first). RuntimeError (one line) once `alive()` is False or the
        trainer's store is gone."""
        no_limit = time.monotonic() + 365 * 24 * 3600.0
        self.wait_for([f"publish/{self.publishes + 1}"], alive, "next publish", no_limit)

    def send(
        self,
        version: int,
        buckets: Iterable[list[torch.Tensor]],
        alive: Callable[[], bool] = lambda: True,
    ) -> float | None:
        """Rank 0: announce, then broadcast `buckets` (tensors in `named_parameters()` order) as
        `version`."""
        self.wait(alive)
        self.announce(version)
        version_tensor = torch.tensor([version], dtype=torch.int64, device=self.device)
        self._pending = [self._broadcast(version_tensor)]
        digest = new_digest(self.checksum)
        for given in buckets:
            for r in bucket_ranges([t.numel() for t in given], self.bucket_elems):
                flat = flatten([given[i] for i in r], self.wire_dtype, self.device)  # [bucket]
                self._pending.append(self._broadcast(flat))
                if digest is not None:
                    digest.add([flat])  # while it is on its way (read only)
                if self.bucket_elems:
                    self.wait(alive)
        return digest.value if digest is not None else None

    def announced(self) -> int:
        """Rank >= 1: the newest version rank 0 has started to publish (-1: none); never blocks."""
        try:
            return int(self.store.get("published")) if self.store.check(["published"]) else -1
        except dist.DistError as e:
            raise RuntimeError(
                f"weight sync: the trainer's store at {self.host}:{self.port} stopped answering "
                f"(the trainer is gone: {' '.join(str(e).split())})"
            ) from None

    def recv(self, params: list[torch.Tensor], alive: Callable[[], bool] = lambda: True) -> int:
        """Rank >= 1: receive the next publish into `params` in place; returns its version."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._pending = [self._broadcast(version)]
        ranges = bucket_ranges([p.numel() for p in params], self.bucket_elems)
        need = max(sum(params[i].numel() for i in r) for r in ranges)
        if self._flat is None or self._flat.numel() != need or self._flat.dtype != self.wire_dtype:
            self._flat = torch.empty(need, dtype=self.wire_dtype, device=self.device)
        buffer = self._flat
        # CUDA's caching allocator reuses the memory anyway: hold none between publishes
        if self.device.type != "cpu":
            self._flat = None
        for r in ranges:
            ps = [params[i] for i in r]
            flat = buffer[: sum(p.numel() for p in ps)]  # [bucket]
            self._pending.append(self._broadcast(flat))
            self.wait(alive)
            with torch.no_grad():
                for p, part in zip(ps, flat.split([p.numel() for p in ps])):
                    p.copy_(part.view_as(p))
        self.publishes += 1
        return int(version.item())


GOLDEN_RATIO = 0.6180339887498949
CHECKSUM_CHUNK = 2**22  # elements a checksum sums at once: the float64 copy of them takes 32 MiB


class Checksum:
    """An order-sensitive digest of a stream of tensors (--sync-checksum): the float64 sum of
    each element times a weight in [1, 2) set by its position in the stream (the fractional
    part of position x the golden ratio), so that two swapped tensors of one shape or a
    mis-mapped parameter change it, which a plain sum would not. Tensors may come whole or
    flattened into buckets: the position runs on across `add` calls."""

    def __init__(self):
        self.position = 0
        self.value = 0.0

    def add(self, tensors: Iterable[torch.Tensor]) -> "Checksum":
        for t in tensors:
            for chunk in t.detach().reshape(-1).split(CHECKSUM_CHUNK):
                end = self.position + chunk.numel()
                k = torch.arange(self.position, end, dtype=torch.float64, device=chunk.device)
                weight = 1.0 + torch.frac(k * GOLDEN_RATIO)  # [n]
                self.value += float((chunk.double() * weight).sum())
                self.position = end
        return self


def checksum(tensors: Iterable[torch.Tensor]) -> float:
    """The `Checksum` of `tensors`, in order."""
    return Checksum().add(tensors).value


def new_digest(checksum: bool) -> Checksum | None:
    """An empty `Checksum` when `checksum` (--sync-checksum), else None: by default no end makes
    a pass over the weights."""
    if not checksum:
        return None
    return Checksum()


def flatten(
    tensors: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`tensors` in order, each cast into its slice of a new tensor [sum of numels] of `dtype` on
    `device`, or of the first elements of `out` (a 1-D tensor at least that long, whose dtype and
    device are then those used)."""
    numel = sum(t.numel() for t in tensors)
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=device)
    flat = out[:numel]
    # no second copy of the bucket
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        part.copy_(t.detach().reshape(-1))
    return flat


def bucket_ranges(numels: list[int], limit: int) -> list[range]:
    """Consecutive index ranges of at most `limit` elements (a larger tensor alone; 0: one
    range)."""
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


class Receiver:
    """The explorer's end: takes published weights into `engine` and logs them; of `cfg` it reads
    the sync host and sync timeout. `port`: the weight-sync group's, whose class is `transport`
    (WeightSync, or one with its interface); None: `source` announces and loads the weights
    (checkpoints)."""

    def __init__(
        self,
        engine,
        cfg,
        log: Callable[[dict], None],
        alive: Callable[[], bool],
        port: int | None = None,
        device: str = "cpu",
        transport: type = WeightSync,
        source=None,
    ):
        self.engine = engine
        self.cfg = cfg
        self.log = log
        self.alive = alive
        self.port = port
        self.device = device
        self.transport = transport
        # what announces and receives the weights: the engine's group, or the source given
        self.source = engine if port is not None else source

    def join(self) -> None:
        """Broadcast: join the weight-sync group (blocks until every rank is there)."""
        if self.port is not None:
            self.engine.join_weight_sync(
                self.cfg.sync_host,
                self.port,
                self.cfg.sync_timeout_s,
                self.alive,
                self.device,
                self.transport,
            )

    def newest(self) -> int:
        """The newest version the trainer has published or started to publish (-1: none)."""
        return self.source.weights_announced()

    def until(self, version: int) -> None:
        """Block until the engine has `version` (checkpoint sync: exactly it, not a newer one)."""
        while self.engine.version < version:
            self.receive(version)

    def receive(self, version: int | None = None) -> None:
        """Block until a newer version (checkpoint sync: `version`) is loaded; RuntimeError once
        `alive()` is False."""
        t0 = time.perf_counter()
        if self.port is None:  # waits until checkpoint `version` (or a newer one) is published
            _, digest = self.source.receive_weights(self.alive, version)
        else:
            # a receive posted before its publish counts against NCCL's timeout: announced first
            self.source.wait_weights(self.alive)
            _, digest = self.source.receive_weights(self.alive)
        record = {
            "explorer/received_version": self.engine.version,
            "time/explorer_wait_sync_s": time.perf_counter() - t0,
        }
        self.log(record if digest is None else {**record, "sync/explorer_checksum": digest})


def bucket_elems(cfg) -> int:
    """The weight-sync bucket in elements: --sync-bucket-mb MiB of float32; 0 = unbucketed."""
    return int(cfg.sync_bucket_mb * 2**20) // 4


class SentWeights:
    """The weight publisher of broadcast and ipc sync: rank 0 sends to the explorers' group
    (`send(version, buckets)` -> checksum or None; None on the other ranks, which take part in
    the gathers), in buckets of `bucket_elems` (0: all at once)."""

    def __init__(self, send: Callable | None, bucket_elems: int):
        self.send = send
        self.bucket_elems = bucket_elems

    def publish(self, trainer) -> tuple[float | None, list | None]:
        """(the checksum sent, the full parameters when gathered at once). Collective."""
        if self.bucket_elems:
            buckets = trainer.parameter_buckets(self.bucket_elems)
            digest = self.send(trainer.version, buckets) if self.send else None
            for _ in buckets:  # the other ranks take part in every gather
                pass
            return digest, None
        params = trainer.full_parameters()
        return (self.send(trainer.version, [params]) if self.send else None), params
