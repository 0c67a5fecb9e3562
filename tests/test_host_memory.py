"""`--kv-cache-memory auto`: a share of the host memory available at start, less a reserve, within
/dev/shm's free space; an explicit size wins; a host without room refuses with the way out."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from moe_lightning.config.host_memory import (
    KV_SHARE,
    RESERVE_BYTES,
    HostMemory,
    auto_kv_cache_memory,
    parse_kv_cache_memory,
    resolve_kv_cache_memory,
)
from moe_lightning.kv_format import bytes_per_token
from moe_lightning.launcher import Stack
from moe_lightning.shm.pages import EXIT_NO_SHARED_MEMORY, SharedMemoryFullError, shortage
from moe_lightning.spec import ModelSpec

GiB = 1 << 30


def test_reads_this_hosts_memory_and_shm(tmp_path: Path) -> None:
    host = HostMemory.read()
    assert 0 < host.available <= host.total and host.shm_free > 0
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    none = tmp_path / "none"
    assert HostMemory.read(fake, tmp_path, none, none).available == 20000000 * 1024


def _cgroup_v2(root: Path, limits: dict[str, str], current: int, inactive: int) -> Path:
    (root / "cgroup.controllers").parent.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for rel, limit in limits.items():
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(limit + "\n")
    leaf = root / max(limits, key=len)
    (leaf / "memory.current").write_text(f"{current}\n")
    (leaf / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 7\n")
    me = root.parent / "self-cgroup"
    me.write_text(f"0::/{max(limits, key=len)}\n")
    return me


def test_a_containers_limit_is_what_it_may_use(tmp_path: Path) -> None:
    """/proc/meminfo in a container is the host's; the cgroup's limit (the tightest of its ancestors')
    less its working set (page cache it may drop aside) is what the KV segment may take."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    root = tmp_path / "v2" / "fs"
    me = _cgroup_v2(root, {"kubepods": str(8 * GiB), "kubepods/pod1": "max"}, 5 * GiB, 2 * GiB)
    boxed = HostMemory.read(meminfo, tmp_path, root, me)
    assert boxed.total == 8 * GiB and boxed.available == 8 * GiB - (5 - 2) * GiB  # the checkpoint's pages are not used
    unlimited = tmp_path / "v2b" / "fs"
    me = _cgroup_v2(unlimited, {"a": "max"}, 5 * GiB, 0)
    assert HostMemory.read(meminfo, tmp_path, unlimited, me).total == 24000000 * 1024
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker" / "c1").mkdir(parents=True)
    leaf = v1 / "memory" / "docker" / "c1"
    (leaf / "memory.limit_in_bytes").write_text(f"{6 * GiB}\n")
    (leaf / "memory.usage_in_bytes").write_text(f"{4 * GiB}\n")
    (leaf / "memory.stat").write_text(f"cache 9\nhierarchical_memory_limit {7 * GiB}\ntotal_inactive_file {GiB}\n")
    me = tmp_path / "self-v1"
    me.write_text("12:cpu,cpuacct:/docker/c1\n4:memory:/docker/c1\n")
    boxed = HostMemory.read(meminfo, tmp_path, v1, me)
    assert (boxed.total, boxed.available) == (6 * GiB, 3 * GiB)


def test_auto_takes_a_share_past_the_reserve_within_shm() -> None:
    host = HostMemory(total=24 * GiB, available=20 * GiB, shm_free=24 * GiB)
    reserve = max(RESERVE_BYTES, int(0.1 * host.total))
    budget = auto_kv_cache_memory(host)
    assert budget.nbytes == int(KV_SHARE * (20 * GiB - reserve)) and "available" in budget.reason
    small_shm = HostMemory(total=24 * GiB, available=20 * GiB, shm_free=8 * GiB)
    assert auto_kv_cache_memory(small_shm).nbytes == int(KV_SHARE * (8 * GiB - reserve))  # the segment lives there
    pending = auto_kv_cache_memory(host, pending=1 * GiB).nbytes  # shared memory the start makes later
    assert pending == int(KV_SHARE * (20 * GiB - reserve - GiB))
    with pytest.raises(ValueError, match="give --kv-cache-memory a size"):
        auto_kv_cache_memory(HostMemory(total=4 * GiB, available=2 * GiB, shm_free=4 * GiB))


def test_auto_short_of_dev_shm_is_a_shortage_that_up_retries() -> None:
    """/dev/shm, not the host, is what is short (another user filled it): the start fails as one that
    lacked shared memory (exit 75, retried by `up`), saying how much /dev/shm has and auto needed."""
    host = HostMemory(total=24 * GiB, available=20 * GiB, shm_free=2 * GiB)
    with pytest.raises(SharedMemoryFullError) as err:
        auto_kv_cache_memory(host)
    text = str(err.value)
    assert text.startswith("/dev/shm has 2.00 GiB free, the KV cache (--kv-cache-memory auto: 90% of 2.00 GiB")
    assert "leaves 0 B) needs 2.47 GiB: free space in /dev/shm or give --kv-cache-memory a size" in text
    try:
        raise RuntimeError("start failed") from err.value
    except RuntimeError as wrapped:
        assert shortage(wrapped) is err.value and EXIT_NO_SHARED_MEMORY == 75


def test_an_explicit_size_wins_and_the_flag_parses_both() -> None:
    host = HostMemory(total=4 * GiB, available=1 * GiB, shm_free=1 * GiB)  # auto would refuse here
    assert resolve_kv_cache_memory(32 << 20, host).nbytes == 32 << 20
    assert parse_kv_cache_memory("auto") == "auto" and parse_kv_cache_memory("AUTO") == "auto"
    assert parse_kv_cache_memory("64MiB") == 64 << 20
    with pytest.raises(argparse.ArgumentTypeError, match="expected auto or a size"):
        parse_kv_cache_memory("lots")


def test_a_stack_on_auto_sizes_its_cache_by_the_host_and_says_so(
    tiny_model: Path, make_stack: Callable[..., Stack]
) -> None:
    from moe_lightning.client import GenerationClient

    before = auto_kv_cache_memory(HostMemory.read()).nbytes
    stack = make_stack(model=tiny_model, kv_cache_memory="auto")
    after = auto_kv_cache_memory(HostMemory.read()).nbytes
    with GenerationClient(stack.api_address, timeout=60) as c:
        tokens = c.server_metadata().kv_cache_tokens
    spec = ModelSpec.from_pretrained(tiny_model)
    per_token = bytes_per_token("float32", spec.num_layers, spec.num_kv_heads, spec.head_dim)
    lines = (stack.config.log_dir / "cpu_attention.log").read_text().splitlines()
    chosen = next(json.loads(x) for x in lines if '"kv_cache_memory"' in x)
    assert "of" in chosen["chosen"] and "reserve" in chosen["chosen"]
    assert chosen["bytes"] // per_token // 16 * 16 == tokens  # the cache holds what it said it took
    # the host's free memory moves under a shared machine's other users: the choice lies near both reads
    assert 0.8 * min(before, after) <= chosen["bytes"] <= 1.2 * max(before, after)
