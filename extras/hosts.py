"""Networking apart from the trainer: `gloo_interface` (gloo across hosts) and `StoreAlive` (watching the trainer)."""

import ipaddress
import os
from datetime import timedelta

import psutil
import torch.distributed as dist

import sync


class StoreAlive:
    """Whether trainer rank 0's weight-sync store answers; RuntimeError when none does within `wait_s`."""

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


def gloo_interface(master: str) -> str | None:
    """The interface on the route to `master` (None: no route, or this host), set as GLOO_SOCKET_IFNAME: gloo
    would bind the hostname's address, often loopback (Debian: 127.0.1.1), where other nodes cannot reach it."""
    try:
        address = sync.local_address(master)
    except OSError:  # no route to it: torch's own error names the address
        return None
    if ipaddress.ip_address(address).is_loopback:  # one host
        return None
    if (name := interface_of(address)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address` (e.g. "eth0"), else None."""
    return next(
        (
            name
            for name, addrs in psutil.net_if_addrs().items()
            if any(a.address == address for a in addrs)
        ),
        None,
    )
