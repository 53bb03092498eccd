"""Weight sync by handle (--sync-method ipc): rank 0 puts a handle of each weight bucket (CUDA IPC; shared memory on
the CPU) into the weight-sync store and keeps the bucket until the explorer has copied it in place and acknowledged.
After vLLM's `ColocateWorkerExtension` (rlhf_colocate.py @ 04ba446, rlhf_utils.py @ 081b8e3), the store for ZMQ."""

import pickle
import time
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

import sync

STORAGE_DEVICE = 6  # the argument of rebuild_cuda_tensor naming the GPU, by the sender's numbering (rlhf_utils.py)


def check_placement(cfg, layout) -> None:
    """launch.sync_method's check of --sync-method ipc: ValueError (one line) unless the explorer
    shares trainer rank 0's device in `layout` (a launch.Placement) and is an hf engine of mode both."""
    shared = (
        cfg.mode == "both" and cfg.engine == "hf" and layout.explorer in ("cpu", layout.trainer[0])
    )
    if not shared:
        raise ValueError(
            "--sync-method ipc hands the weights to an hf engine on trainer rank 0's device: mode both, "
            "--engine hf, as many GPUs as trainer ranks (or none)"
        )


class IpcSync(sync.WeightSync):
    """WeightSync's store, ranks and wire dtype without its process group: each bucket goes as a handle of one
    tensor on the device the weights are on (`device` takes part in the handshake only)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending, self.handed, self.taken = (
            [],
            0,
            0,
        )  # rank 0: (bucket, tensor, deadline) until acknowledged

    def _group(self) -> None:
        return None

    def send(
        self,
        version: int,
        buckets: Iterable[list[torch.Tensor]],
        alive: Callable[[], bool] = lambda: True,
    ) -> float | None:
        """Rank 0: announce, then hand out `buckets` (tensors in `named_parameters()` order) as `version`."""
        self.wait(alive)
        self.store.set("published", str(version))
        digest = sync.new_digest(self.checksum)
        for given in buckets:
            for r in sync.bucket_ranges([t.numel() for t in given], self.bucket_elems):
                self._hand_out(version, [given[i] for i in r], digest)
                if self.bucket_elems:
                    self.wait(alive)
        return digest.value if digest is not None else None

    def _hand_out(self, version: int, tensors: list[torch.Tensor], digest) -> None:
        """Put a handle of `tensors` in one new tensor into the store; it is held until
        acknowledged. The tensor is added to `digest` (--sync-checksum: a Checksum, else None)."""
        flat = sync.flatten(tensors, self.wire_dtype, tensors[0].device)  # [bucket]
        if flat.is_cuda:  # written before another process reads it
            torch.cuda.synchronize(flat.device)
        else:  # a CPU tensor then pickles as a shared-memory file's name, which the store can carry
            mp.set_sharing_strategy("file_system")
        handle = ForkingPickler.dumps((version, sync.gpu_id(flat.device), reduce_tensor(flat)))
        self.store.set(f"ipc/{self.handed}", bytes(handle))
        self._pending.append((self.handed, flat, time.monotonic() + self.timeout.total_seconds()))
        self.handed += 1
        if digest is not None:
            digest.add([flat])

    def wait(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Rank 0: hold each bucket handed out until every explorer has acknowledged it; then let it go."""
        while self._pending:
            bucket, _, deadline = self._pending[0]
            self._until(
                lambda: self.store.add(f"ipc_ack/{bucket}", 0) >= self.world_size - 1,
                alive,
                f"acknowledgement of bucket {bucket}",
                deadline,
            )
            self.store.delete_key(f"ipc/{bucket}")
            self.store.delete_key(f"ipc_ack/{bucket}")
            self._pending.pop(0)

    def recv(self, params: list[torch.Tensor], alive: Callable[[], bool] = lambda: True) -> int:
        """Rank >= 1: copy the next publish into `params` in place, bucket by bucket; returns its version.
        RuntimeError: the trainer's weights are on another GPU or have other sizes."""
        for r in sync.bucket_ranges([p.numel() for p in params], self.bucket_elems):
            key, ps = f"ipc/{self.taken}", [params[i] for i in r]
            self._until(lambda: self.store.check([key]), alive, "next bucket from the trainer")
            version, gpu, (rebuild, args) = pickle.loads(self.store.get(key))
            if rebuild is rebuild_cuda_tensor:
                if gpu != sync.gpu_id(ps[0].device):
                    raise RuntimeError(
                        f"weight sync: --sync-method ipc needs the explorer on the trainer's GPU "
                        f"({gpu}); this explorer's weights are on {ps[0].device}"
                    )
                args = (*args[:STORAGE_DEVICE], ps[0].device.index, *args[STORAGE_DEVICE + 1 :])
            flat = rebuild(*args)  # [bucket] the trainer's memory
            if flat.numel() != sum(p.numel() for p in ps):
                raise RuntimeError(
                    f"weight sync: a bucket of {flat.numel()} elements for {sum(p.numel() for p in ps)}"
                    " parameters: the trainer publishes other weights than this explorer holds"
                )
            copy_into(ps, flat)
            if flat.is_cuda:  # copied before the trainer may free it
                torch.cuda.synchronize(flat.device)
            del flat, args  # no handle of the trainer's memory outlives the acknowledgement
            self.store.add(f"ipc_ack/{self.taken}", 1)
            self.taken += 1
        return version

    def _until(
        self,
        ready: Callable[[], bool],
        alive: Callable[[], bool],
        what: str,
        deadline: float | None = None,
    ) -> None:
        """Poll `ready()` (from 0.1 ms apart up to 10 ms); RuntimeError once `alive()` is False or at `deadline`."""
        deadline, pause = deadline or time.monotonic() + self.timeout.total_seconds(), 1e-4
        peer = "an explorer" if self.rank == 0 else "the trainer"
        try:
            while not ready():
                if not alive():
                    raise RuntimeError(f"weight sync: {peer} died (waiting for {what})")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weight sync: no {what} within --sync-timeout-s "
                        f"{self.timeout.total_seconds():g} s"
                    )
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
        except dist.DistError as e:  # a receiver's store connection: rank 0 is gone
            raise RuntimeError(
                f"weight sync: the trainer's store at {self.host}:{self.port} stopped answering (the "
                f"trainer is gone: {' '.join(str(e).split())})"
            ) from None


def copy_into(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of `flat` [sum of numels] into `params` in place."""
    with torch.no_grad():
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(part.view_as(p))
