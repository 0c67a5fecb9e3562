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


def test_two_processes_picking_ports_at_once_never_get_the_same_one() -> None:
    """Two launchers on one box (Ray's node stacks in a test, or two `up`s) pick ports at the same time,
    before any child binds one: the per-user claims keep their picks apart (a CI run lost an
    orchestrator to "Address already in use")."""
    import subprocess
    import sys

    script = "from moe_lightning.children import free_port; print(*(free_port() for _ in range(200)))"
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    picks = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(picks[0]) == len(picks[1]) == 200 and not picks[0] & picks[1]
