"""The tensor-parallel group of gpu_expert ranks: joining it, the collectives a step needs, and the
commands rank 0 sends the others (docs/parallel.md).

Rank 0 leads: it alone talks to the orchestrator and to cpu_attention and samples. Each step it
sends the other ranks the Step it got (a broadcast), every rank runs it on its slice, and per layer
and micro-batch rank 0 gathers the ranks' q/k/v heads for the one hand-off to cpu_attention and
scatters the attention result back by heads, and o_proj and the experts end in all-reduces. The
hand-off stays one message on one channel (cpu_attention is unchanged); the q/k/v of a rank is
1/N of a layer's, small next to the expert pages that dominate the link.

Two process groups: gloo for commands and the host-side gathers (what cpu_attention reads is on
the host anyway), and one for the all-reduces of device tensors: NCCL on CUDA, gloo on CPU (or
with --tp-backend gloo, which also takes CUDA tensors: two ranks on one GPU, which NCCL refuses).
Every collective has a timeout (--tp-timeout); an idle leader sends a heartbeat so that the
others' wait for the next command never outlasts it. A failed collective is a `RankGroupError`:
the group is broken and every rank exits; the launcher restarts rank 0, which forms a new group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import fields
from datetime import timedelta
from enum import IntEnum
from pathlib import Path
from typing import TypeVar

import grpc
import torch
import torch.distributed as dist

from moe_lightning.service.errors import ServiceError
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import RankStep
from moe_lightning.tensor_parallel import Shard, kv_heads, kv_owner, query_heads

T = TypeVar("T")
HEARTBEAT_SECONDS = 5.0  # at most; a third of --tp-timeout when that is shorter


class RankGroupError(ServiceError):
    """A collective failed or timed out: a rank died or hangs. The group cannot go on."""

    def __init__(self, message: str) -> None:
        super().__init__(message, grpc.StatusCode.UNAVAILABLE)


class Command(IntEnum):
    HEARTBEAT = 0
    STEP = 1  # payload: the StepRequest
    CONNECT = 2  # payload: the ConnectRequest
    STOP = 3


class RankGroup:
    def __init__(
        self,
        spec: ModelSpec,
        shard: Shard,
        device: torch.device,
        backend: str,
        timeout: float,
        rendezvous: Path,
        startup_timeout: float = 900.0,
    ) -> None:
        """Joins the group: waits up to `startup_timeout` for every rank to arrive (a rank imports
        torch and maps the arena first), then every collective waits at most `timeout`."""
        self.spec, self.shard, self.device = spec, shard, device
        self.timeout = timedelta(seconds=timeout)
        self.heartbeat_seconds = min(HEARTBEAT_SECONDS, timeout / 3)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the group talks over loopback only
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        try:
            # the default group only forms the group (its timeout: the slowest rank's start); every
            # collective of a step runs on groups with the tight --tp-timeout
            startup = timedelta(seconds=startup_timeout)
            store = dist.FileStore(str(rendezvous), shard.world)
            store.set_timeout(startup)
            rank, world = shard.rank, shard.world
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=startup)
            if backend == "auto":
                backend = "nccl" if device.type == "cuda" else "gloo"
            self.host_group = dist.new_group(backend="gloo", timeout=self.timeout)
            self.device_group = (
                dist.new_group(backend=backend, timeout=self.timeout) if backend != "gloo" else self.host_group
            )
        except Exception as exc:
            raise RankGroupError(f"rank {shard.rank} of {shard.world} could not join the group: {exc}") from exc
        self.backend = backend
        self.last_command = time.monotonic()  # rank 0: when the others last heard from it
        self.collectives_ns = 0  # time in collectives, since the last take_collective_ns()
        self._q_heads = len(query_heads(spec, shard))
        self._kv_heads = len(kv_heads(spec, shard))

    # ---- life -----------------------------------------------------------------------------------
    def wait_all_ready(self, timeout: float) -> None:
        """Every rank has built its slice (warm-up and calibration may take minutes)."""
        self._run("start-up barrier", lambda: dist.monitored_barrier(timeout=timedelta(seconds=timeout)))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- commands (rank 0 -> the others) --------------------------------------------------------
    def send_command(self, command: Command, payload: bytes = b"") -> None:
        assert self.shard.leads
        self.last_command = time.monotonic()
        head = torch.tensor([int(command), len(payload)], dtype=torch.int64)
        self._run("command", lambda: dist.broadcast(head, 0, group=self.host_group))
        if payload:
            body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            self._run("command", lambda: dist.broadcast(body, 0, group=self.host_group))

    def receive_command(self) -> tuple[Command, bytes]:
        head = torch.empty(2, dtype=torch.int64)
        self._run("command", lambda: dist.broadcast(head, 0, group=self.host_group))
        command, n = Command(int(head[0])), int(head[1])
        if not n:
            return command, b""
        body = torch.empty(n, dtype=torch.uint8)
        self._run("command", lambda: dist.broadcast(body, 0, group=self.host_group))
        return command, body.numpy().tobytes()

    # ---- a step's collectives -------------------------------------------------------------------
    def together(self, prepare: Callable[[], T]) -> T:
        """`prepare()` (a step's checks), with every rank going on, or refusing the step, together:
        a refusal on one rank alone (a full device KV cache, an out-of-memory) would leave the others
        waiting in the step's first collective."""
        try:
            result = prepare()
        except Exception:
            self.agree(False)
            raise
        if not self.agree(True):
            raise ServiceError(
                "another tensor-parallel rank refused this step (its log says why)", grpc.StatusCode.UNAVAILABLE
            )
        return result

    def agree(self, ok: bool) -> bool:
        """Whether every rank's `ok` is true: ranks go on with a step, or refuse it, together."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        self._run("agreement", lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.host_group))
        return bool(flag.item())

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `t` (in place when `t` is contiguous). A collective adds
        the ranks' buffers element by element in memory order, and each rank races its own dense
        kernels (one may hand back a transposed view, another a row-major tensor): a partial is
        made row-major first, or rows of one rank would be added to columns of another."""
        t = t.contiguous()
        self._run("all-reduce", lambda: dist.all_reduce(t, group=self.device_group))
        return t

    def gather_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Every rank's heads -> the whole layer's q (T, H, Hd), k, v (T, K, Hd) on rank 0 (None on
        the others). A KV head held by several ranks (K < N) comes from the first of them."""
        mine = torch.cat([q, k, v], dim=1).to("cpu")  # (T, H/N + 2 K_r, Hd)
        parts = [torch.empty_like(mine) for _ in range(self.shard.world)] if self.shard.leads else None
        self._run("gather", lambda: dist.gather(mine, parts, dst=0, group=self.host_group))
        if parts is None:
            return None
        hq, hk = self._q_heads, self._kv_heads
        spec, world = self.spec, self.shard.world
        full_q = torch.cat([p[:, :hq] for p in parts], dim=1)
        keys, values = [], []
        for head in range(spec.num_kv_heads):
            owner = kv_owner(spec, world, head)
            j = head - kv_heads(spec, Shard(owner, world)).start
            keys.append(parts[owner][:, hq + j])
            values.append(parts[owner][:, hq + hk + j])
        dev = self.device
        return full_q.to(dev), torch.stack(keys, dim=1).to(dev), torch.stack(values, dim=1).to(dev)

    def scatter_heads(self, attn: torch.Tensor | None, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank 0's attention result (T, H * Hd) -> each rank's heads (T, H/N * Hd) on its device."""
        width = self._q_heads * self.spec.head_dim
        mine = torch.empty(tokens, width, dtype=dtype)
        parts = None
        if attn is not None:
            parts = [c.contiguous() for c in attn.to("cpu").view(tokens, self.shard.world, width).unbind(1)]
        self._run("scatter", lambda: dist.scatter(mine, parts, src=0, group=self.host_group))
        return mine.to(self.device)

    def gather_stats(self, stats: RankStep) -> list[RankStep]:
        """Every rank's share of the step on rank 0 (an empty list elsewhere)."""
        row = torch.tensor([getattr(stats, f.name) for f in fields(RankStep)], dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.shard.world)] if self.shard.leads else None
        self._run("gather", lambda: dist.gather(row, rows, dst=0, group=self.host_group))
        return [RankStep(*(int(x) for x in r.tolist())) for r in rows] if rows else []

    def take_collective_ns(self) -> int:
        ns, self.collectives_ns = self.collectives_ns, 0
        return ns

    def _run(self, what: str, op: object) -> None:
        t0 = time.perf_counter_ns()
        try:
            op()  # type: ignore[operator]
        except Exception as exc:  # gloo: a peer's socket closed, or the timeout; NCCL: its watchdog
            raise RankGroupError(
                f"tensor-parallel {what} failed on rank {self.shard.rank} of {self.shard.world} "
                f"(a rank died or hangs; the group restarts): {str(exc).splitlines()[0] if str(exc) else exc!r}"
            ) from exc
        self.collectives_ns += time.perf_counter_ns() - t0
