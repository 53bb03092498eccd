"""`StoreAlive`: whether trainer rank 0's weight-sync store still answers (an explorer on another
host)."""

from datetime import timedelta

import torch.distributed as dist


class StoreAlive:
    """Whether trainer rank 0's weight-sync store answers; RuntimeError when none does within
    `wait_s`."""

    def __init__(self, host: str, port: int, wait_s: float):
        try:  # a client of its own: a WeightSync's may be blocked in the rendezvous
            self.store = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=wait_s)
            )
        except dist.DistError:
            raise RuntimeError(
                f"weight sync: no trainer answered at {host}:{port} within {wait_s:.0f} s (is it "
                "running, with the same --sync-host/--sync-port?)"
            ) from None

    def __call__(self) -> bool:
        try:
            return self.store.check(["world"])
        except dist.DistError:  # "Connection was likely closed", "Broken pipe": the store is gone
            return False
