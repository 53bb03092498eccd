"""Networking that only runs across several hosts need: which network interface gloo binds
(launch.gloo_interface calls `interface_of` by import path when MASTER_ADDR is not loopback)."""
from __future__ import annotations

import fcntl
import socket
import struct


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 `address` (e.g.
    "eth0"), or None when none does (or `address` is not IPv4)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(got) == address:
            return name
    return None
