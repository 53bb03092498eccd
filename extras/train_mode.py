"""Mode train beside `--mode explore` launches (fully asynchronous): trainer rank 0's end
of their weight-sync group, and their evaluations read back from the shared buffer.
loop.py reaches both by import path (loop.EXPLORERS_GROUP, loop.EXPLORER_RECORDS).
"""
from __future__ import annotations

from typing import Callable

from loop import weight_group
from metrics import print0


def connect_explorers(cfg, io, layout, version: int, params):
    """Rank 0 with broadcast sync: host the weight-sync store on cfg.sync_host:cfg.sync_port,
    wait (up to sync_timeout_s) until cfg.num_explorers explorers have joined, send them
    `params` (= `version`) if this trainer was resumed, and connect `io` to the group.
    Returns the sync.WeightSync."""
    weights = weight_group(cfg, layout, cfg.num_explorers)
    print0(f"weight sync: waiting for {cfg.num_explorers} explorer(s) at {cfg.sync_host}:{weights.port}")
    weights.connect()
    if weights.device.type != layout.sync_device:  # sync.group_backend
        print0("weight sync: an explorer shares trainer rank 0's GPU, where NCCL cannot have two ranks: the weights "
               "go through host memory (gloo)")
    io.send_weights = weights.send
    if params is not None:
        weights.send(version, [params])
    return weights


def records_from_buffer(buffer) -> Callable[[], list[dict]]:
    """A `LoopIO.records` that returns the explorers' records added to `buffer` since its
    last call (they run in other launches: the buffer is what the sides share)."""
    last = 0

    def records() -> list[dict]:
        nonlocal last
        last, new = buffer.records_after(last)
        return new

    return records
