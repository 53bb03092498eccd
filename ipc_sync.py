"""Weight sync by handle (--sync-method ipc): rank 0 writes each publish into a staging tensor on
the device the weights are on, whose handle (CUDA IPC; shared memory on the CPU) the explorers map
once, and announces it by a key of the weight-sync store; each explorer copies it in place and
acknowledges it by a key of its own before the next publish may overwrite it: one write, one
announcement and one acknowledgement per publish, the gathers of --sync-bucket-mb's buckets each
written into its slice. After vLLM's `ColocateWorkerExtension` (rlhf_colocate.py @ 04ba446,
rlhf_utils.py @ 081b8e3), the store for ZMQ.

A module of its own beside sync.py: the weight-sync method that --sync-method auto picks on one
GPU, a protocol of both ends (trainer rank 0 and the explorer) with sync.WeightSync's
interface."""

import os
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterable

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

import sync

# the argument of rebuild_cuda_tensor naming the GPU, by the sender's numbering (rlhf_utils.py)
STORAGE_DEVICE = 6


def check_placement(cfg, layout) -> None:
    """components.sync_method's check of --sync-method ipc: ValueError (one line) unless the
    explorer shares trainer rank 0's device in `layout` (a launch.Placement) and is an hf engine of
    mode both, and on a GPU unless the CUDA allocator can hand out handles (`cuda_ipc_allowed`)."""
    if not shares_rank_0s_device(cfg, layout):
        raise ValueError(
            "--sync-method ipc hands the weights to an hf engine on trainer rank 0's device: "
            "mode both, --engine hf, as many GPUs as trainer ranks (or none)"
        )
    if layout.explorer.startswith("cuda") and not cuda_ipc_allowed():
        raise ValueError(
            "--sync-method ipc needs CUDA IPC handles, which PYTORCH_CUDA_ALLOC_CONF's "
            "cudaMallocAsync or expandable segments do not give: leave them out or use "
            "--sync-method broadcast"
        )


def shares_rank_0s_device(cfg, layout) -> bool:
    """Whether mode both's hf engine runs on trainer rank 0's device (or both on the CPU) in
    `layout`."""
    return (
        cfg.mode == "both" and cfg.engine == "hf" and layout.explorer in ("cpu", layout.trainer[0])
    )


def cuda_ipc_allowed() -> bool:
    """Whether the CUDA caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF)
    let a tensor go by CUDA IPC handle: not from cudaMallocAsync's pools, and not from expandable
    segments, whose handles need pidfd_getfd, which containers often refuse."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    conf = conf.replace(" ", "")
    return "cudaMallocAsync" not in conf and "expandable_segments:True" not in conf


class IpcSync(sync.WeightSync):
    """WeightSync's store, ranks, wire dtype and announcements without its process group (`device`
    takes part in the handshake only)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # rank 0: the staging tensor [elements] each publish is written into
        self.staging = None
        # rank 0: the staging tensor last handed out, and how many were (the key of the last:
        # ipc/staging/N)
        self.shared = None
        self.stagings = 0
        # rank 0: the time.monotonic() by which the explorers must have acknowledged the publish in
        # staging
        self.deadline = None
        # rank >= 1: (N, the trainer's staging tensor N, mapped)
        self.mapped = None

    def _group(self) -> None:
        return None

    def send(
        self,
        version: int,
        buckets: Iterable[list[torch.Tensor]],
        alive: Callable[[], bool] = lambda: True,
    ) -> float | None:
        """Rank 0: once the explorers have copied the publish before, write `buckets` (tensors in
        `named_parameters()` order, gathered as they are asked for) into staging and announce them
        as `version`; returns without waiting for the acknowledgement (the next publish waits for
        it)."""
        self.wait(alive)
        written = 0
        for given in buckets:
            numel = sum(t.numel() for t in given)
            self._fit(written + numel, given[0].device, written)
            sync.flatten(given, self.wire_dtype, given[0].device, out=self.staging[written:])
            written += numel
        # grown by this publish: its exact size, handed out once
        if self.staging is not self.shared:
            if self.staging.numel() > written:
                self.staging = self.staging[:written].clone()
            self._share()
        flat = self.staging[:written]  # [publish]
        if flat.is_cuda:  # written before another process reads it
            torch.cuda.synchronize(flat.device)
        self.announce(version)
        self.store.set(f"ipc/{self.publishes}", f"{version} {written} {self.stagings}")
        self.deadline = time.monotonic() + self.timeout.total_seconds()
        digest = sync.new_digest(self.checksum)
        return digest.add([flat]).value if digest is not None else None

    def _fit(self, numel: int, device: torch.device, kept: int) -> None:
        """Staging of at least `numel` elements on `device`, holding the first `kept` elements of
        the one before: twice as large when it grows, so that a first publish of K buckets copies
        O(log K) times."""
        if (
            self.staging is not None
            and self.staging.numel() >= numel
            and self.staging.device == device
        ):
            return
        before = self.staging
        grown = 2 * before.numel() if before is not None and before.device == device else 0
        self.staging = torch.empty(max(numel, grown), dtype=self.wire_dtype, device=device)
        if kept:
            self.staging[:kept] = before[:kept]

    def _share(self) -> None:
        """Put the handle of staging into the store (ipc/staging/N). torch keeps the one before
        alive while an explorer still maps it (its cache of shared storages); a handle no explorer
        maps would never be freed."""
        # a CPU tensor then pickles as a shared-memory file's name
        if self.staging.device.type == "cpu":
            mp.set_sharing_strategy("file_system")
        self.shared = self.staging
        self.stagings += 1
        handle = ForkingPickler.dumps(
            (sync.gpu_id(self.staging.device), reduce_tensor(self.staging))
        )
        self.store.set(f"ipc/staging/{self.stagings}", bytes(handle))

    def wait(self, alive: Callable[[], bool] = lambda: True) -> None:
        """Rank 0: block until every explorer has acknowledged the publish in staging."""
        if self.deadline is None:
            return
        acks = [f"ipc_ack/{self.publishes}/{r}" for r in range(1, self.world_size)]
        self.wait_for(acks, alive, f"acknowledgement of publish {self.publishes}", self.deadline)
        self.deadline = None

    def recv(self, params: list[torch.Tensor], alive: Callable[[], bool] = lambda: True) -> int:
        """Rank >= 1: copy the next publish into `params` in place; returns its version.
        RuntimeError: the trainer's weights are on another GPU or have other sizes."""
        key = f"ipc/{self.publishes + 1}"
        self.wait_for([key], alive, "next publish from the trainer")
        version, numel, staging = map(int, self.store.get(key).split())
        if numel != sum(p.numel() for p in params):
            raise RuntimeError(
                f"weight sync: a publish of {numel} elements for {sum(p.numel() for p in params)}"
                " parameters: the trainer publishes other weights than this explorer holds"
            )
        copy_into(params, self._map(staging, params[0].device)[:numel])
        if params[0].is_cuda:  # copied before the trainer overwrites it
            torch.cuda.synchronize(params[0].device)
        self.publishes += 1
        self.store.set(f"ipc_ack/{self.publishes}/{self.rank}", "1")
        return version

    def leave(self) -> None:
        """Rank >= 1: let go of the trainer's staging tensor, then leave the store."""
        self.mapped = None
        super().leave()

    def _map(self, staging: int, device: torch.device) -> torch.Tensor:
        """The trainer's staging tensor number `staging`, mapped once. RuntimeError: on another GPU
        than `device`."""
        if self.mapped is not None and self.mapped[0] == staging:
            return self.mapped[1]
        self.mapped = None  # the older one let go first
        gpu, (rebuild, args) = pickle.loads(self.store.get(f"ipc/staging/{staging}"))
        if rebuild is rebuild_cuda_tensor:
            if gpu != sync.gpu_id(device):
                raise RuntimeError(
                    f"weight sync: --sync-method ipc needs the explorer on the trainer's GPU "
                    f"({gpu}); this explorer's weights are on {device}"
                )
            args = (*args[:STORAGE_DEVICE], device.index, *args[STORAGE_DEVICE + 1 :])
        self.mapped = (staging, rebuild(*args))
        return self.mapped[1]


def copy_into(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of `flat` [sum of numels] into `params` in place."""
    with torch.no_grad():
        for p, part in zip(params, flat.split([p.numel() for p in params])):
            p.copy_(part.view_as(p))
