"""Networking that only runs across several hosts need: the network interface gloo binds
(launch.gloo_interface calls `gloo_interface` here when MASTER_ADDR is not loopback)."""
from __future__ import annotations

import ipaddress
import os

import psutil

import sync


def gloo_interface(master: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface on the route to `master` and return it: gloo binds the
    hostname's address, often loopback (Debian: 127.0.1.1), where other nodes cannot reach it. None
    when `master` is unreachable or on this host."""
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
    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.address == address for a in addrs)), None)
