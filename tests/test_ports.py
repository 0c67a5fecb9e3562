"""The ports the launcher hands its services: free, and below the kernel's ephemeral range, where no
other process's outgoing connection can take one before the service binds it."""

from __future__ import annotations

import socket
from pathlib import Path

from moe_lightning.children import free_port


def test_free_ports_are_bindable_distinct_and_outside_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)  # handed out a moment ago: not again
    assert all(1024 <= p < low for p in ports), (low, ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
