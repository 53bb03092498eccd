"""The order-sensitive digest of published weights (--sync-checksum, off by default): `Checksum`
and `checksum`. Both ends of a weight sync report it (sync/trainer_checksum,
sync/explorer_checksum) so that the tests and benchmarks/gpu_check.py can compare what was sent
with what was loaded. Imported only where --sync-checksum asks for it."""

from typing import Iterable

import torch

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
