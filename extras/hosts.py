"""Networking that only runs across several hosts need: the network interface gloo binds
(launch.gloo_interface calls `gloo_interface` here when MASTER_ADDR is not loopback)."""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

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
    """The name of this machine's interface that holds the IPv4 `address` (e.g. "eth0"), else None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(got) == address:
            return name
    return None
