"""`--kv-cache-memory auto`: the host KV cache sized by what the host has free when cpu_attention starts.

As vLLM's --gpu-memory-utilization takes a share of the device, auto takes KV_SHARE of the host
memory available at start (MemAvailable, read after the weight store has loaded the arena, so the
arena is already out of it) less a reserve for the processes' own memory, and no more than
/dev/shm has free, since the cache is a shared-memory segment (docs/kv-cache.md). An explicit size
always wins.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from moe_lightning.config.units import format_size, parse_size
from moe_lightning.shm.pages import SharedMemoryFullError, shm_free

AUTO = "auto"
KV_SHARE = 0.9
RESERVE_BYTES = 2 << 30  # at least this much stays free: torch, activations, hand-off staging, the OS
RESERVE_SHARE = 0.1  # ... or this share of the host's memory, whichever is more
MIN_AUTO_BYTES = 64 << 20  # below this auto refuses to start: the host has no room for a useful cache


@dataclass(frozen=True, slots=True)
class HostMemory:
    total: int  # MemTotal
    available: int  # MemAvailable
    shm_free: int  # what /dev/shm's file system may still hold

    @classmethod
    def read(
        cls,
        meminfo: Path = Path("/proc/meminfo"),
        shm_dir: Path = Path("/dev/shm"),
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        self_cgroup: Path = Path("/proc/self/cgroup"),
    ) -> HostMemory:
        fields = {}
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[name] = int(parts[0]) * 1024  # kB
        total, available = fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))
        # in a container /proc/meminfo is the host's: the cgroup's limit is what this process may use,
        # and the pages of the KV segment are charged to it
        limited = cgroup_limit(cgroup_root, self_cgroup)
        if limited is not None and limited[0] < total:
            total = limited[0]
            available = min(available, limited[0] - limited[1])
        return cls(total, max(0, available), shm_free(shm_dir))


def cgroup_limit(root: Path, self_cgroup: Path) -> tuple[int, int] | None:
    """(memory limit, working set) of this process's cgroup, v2 or v1; None without a limit. The limit
    is the tightest of the cgroup's and its ancestors'; the working set leaves out the inactive page
    cache the kernel reclaims before it would kill (kubelet's measure), so a checkpoint just read does
    not count as used."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        paths["v2" if controllers == "" else controllers] = path
    if "v2" in paths and (root / "cgroup.controllers").exists():
        leaf = _within(root, paths["v2"])
        limits = [_read_int(d / "memory.max") for d in (leaf, *leaf.parents) if d.is_relative_to(root)]
        usage, inactive = _read_int(leaf / "memory.current"), _stat(leaf / "memory.stat", "inactive_file")
    else:
        v1 = next((p for c, p in paths.items() if "memory" in c.split(",")), None)
        if v1 is None:
            return None
        leaf = _within(root / "memory", v1)
        # the effective limit, its ancestors' included, is memory.stat's hierarchical_memory_limit
        limits = [_read_int(leaf / "memory.limit_in_bytes"), _stat(leaf / "memory.stat", "hierarchical_memory_limit")]
        usage, inactive = _read_int(leaf / "memory.usage_in_bytes"), _stat(leaf / "memory.stat", "total_inactive_file")
    found = [x for x in limits if x is not None and x < 1 << 60]  # v1 says "no limit" with a huge number
    if not found:
        return None
    return min(found), max(0, (usage or 0) - (inactive or 0))


def _within(base: Path, path: str) -> Path:
    """The cgroup's directory; in a cgroup namespace the path is relative to the mount itself."""
    here = base / path.lstrip("/")
    return here if here.is_dir() else base


def _read_int(path: Path) -> int | None:
    """A cgroup file's number; None when it is absent or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True, slots=True)
class KVBudget:
    nbytes: int
    reason: str  # how it was chosen, for the start-up log


def auto_kv_cache_memory(host: HostMemory, pending: int = 0) -> KVBudget:
    """KV_SHARE of the available memory past the reserve, within /dev/shm's free space. `pending`: the
    shared memory this start has yet to create besides the cache (the hand-off channels), left out."""
    reserve = max(RESERVE_BYTES, int(RESERVE_SHARE * host.total)) + pending
    room = min(host.available, host.shm_free) - reserve
    nbytes = int(KV_SHARE * room)
    why = (
        f"{KV_SHARE:.0%} of {format_size(min(host.available, host.shm_free))} available "
        f"(memory {format_size(host.available)}, /dev/shm {format_size(host.shm_free)}) less a "
        f"{format_size(reserve)} reserve"
    )
    if nbytes < MIN_AUTO_BYTES and host.shm_free < host.available:  # /dev/shm is what is short: it may come back
        raise SharedMemoryFullError(
            f"the KV cache (--kv-cache-memory auto: {why} leaves {format_size(max(nbytes, 0))})",
            reserve + math.ceil(MIN_AUTO_BYTES / KV_SHARE),  # what auto would need to leave the least cache
            "free space in /dev/shm or give --kv-cache-memory a size",
            host.shm_free,
        )
    if nbytes < MIN_AUTO_BYTES:
        raise ValueError(
            f"--kv-cache-memory auto: {why} leaves {format_size(max(nbytes, 0))}, under the "
            f"{format_size(MIN_AUTO_BYTES)} a KV cache needs; free host memory or give --kv-cache-memory a size"
        )
    return KVBudget(nbytes, why)


def resolve_kv_cache_memory(value: int | str, host: HostMemory | None = None, pending: int = 0) -> KVBudget:
    """The KV cache's bytes: an explicit size as given, auto from the host (auto_kv_cache_memory)."""
    if value != AUTO:
        return KVBudget(int(value), "as given (--kv-cache-memory)")
    return auto_kv_cache_memory(host or HostMemory.read(), pending)


def parse_kv_cache_memory(text: str | int) -> int | str:
    """'auto' or a size ('16GiB')."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    try:
        return parse_size(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or a size like 4GiB, 512MB or 1000000, got {text!r}") from None
