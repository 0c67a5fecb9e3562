"""The attention loop: q/k/v in from the expert service, attention out, KV kept in shared memory."""

from __future__ import annotations

import threading
import time

import structlog
import torch
from prometheus_client import Counter, Gauge

from moe_lightning.kv_cache import KVCacheFullError, PagedKVCache
from moe_lightning.service.metrics import HANDOFF_LATENCY, HANDOFF_WORK, HANDOFFS, KV_USAGE, SHM_WAIT
from moe_lightning.service.metrics import STAGE_BUSY as BUSY
from moe_lightning.shm import (
    ChannelClosedError,
    ChannelTimeoutError,
    PeerDiedError,
    Segment,
    TensorChannel,
    segment_name,
)
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from moe_lightning.timeline import TimelineRecorder

KV_BLOCKS = Gauge("moe_lightning_kv_cache_blocks", "KV cache blocks", ["state"])
ERRORS = Counter("moe_lightning_attention_errors_total", "Attention requests answered with an error", ["code"])


class _Reconnect:
    def __init__(self, name: str) -> None:
        self.name = name
        self.done = threading.Event()
        self.error: Exception | None = None


class AttentionWorker:
    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        run_id: str,
        slot_bytes: int,
        slots: int = 4,
        timeline: TimelineRecorder | None = None,
    ) -> None:
        self.spec = spec
        self.timeline = timeline or TimelineRecorder(None, "cpu_attention")
        self.log = structlog.get_logger()
        shape = PagedKVCache.storage_shape(spec, num_blocks, block_size)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * 4  # fp32 KV on the CPU
        self.kv_segment = Segment.create(segment_name(run_id, "cpu_attention", "kv"), 2 * nbytes)
        storage = (
            self.kv_segment.tensor(0, torch.float32, shape),
            self.kv_segment.tensor(nbytes, torch.float32, shape),
        )
        self.cache = PagedKVCache(spec, num_blocks, block_size, storage=storage)
        self.output = TensorChannel.create(segment_name(run_id, "cpu_attention", "attn"), slots, slot_bytes)
        self.input: TensorChannel | None = None  # owned by the loop thread (see _take_reconnect)
        self._reconnect: _Reconnect | None = None
        self._lock = threading.Lock()  # guards the cache between the loop and Release calls
        self._connected = threading.Condition()
        self._stop = threading.Event()
        self._batches: dict[tuple[int, int], AttentionPlan] = {}
        self.session = 0  # hand-offs of another session are stale (see connect)
        self._thread = threading.Thread(target=self._run, name="attention-loop", daemon=True)
        self._update_gauges()

    def start(self) -> None:
        self._thread.start()

    def connect(self, input_channel: str, session: int = 0, timeout: float = 10.0) -> None:
        """Wires the input channel and starts a new session: the orchestrator (re)connects after
        it or a peer restarted, so every cached sequence belongs to a request that no longer runs.
        The loop thread itself swaps the channel between two receives (closing a handle under a
        blocked receive would break it); this waits until it has."""
        with self._lock:
            self.session = session
            dropped = len(self.cache.tables)
            self.cache.reset()
            self._batches.clear()
            self._update_gauges()
        if dropped:
            self.log.info("session_reset", sequences_dropped=dropped)
        request = _Reconnect(input_channel)
        with self._connected:
            self._reconnect = request
            self._connected.notify_all()
        if not request.done.wait(timeout):
            raise TimeoutError(f"the attention loop did not take channel {input_channel} within {timeout:.0f} s")
        if request.error is not None:
            raise request.error
        self.log.info("input_connected", channel=input_channel)

    def _take_reconnect(self, channel: TensorChannel | None) -> TensorChannel | None:
        """In the loop thread: swaps to a requested channel (old handle closed first, so its
        'closed' flag cannot land after the new handle's attach)."""
        with self._connected:
            request, self._reconnect = self._reconnect, None
        if request is None:
            return channel
        if channel is not None:
            channel.close()
            channel = None
        try:
            channel = TensorChannel.attach(request.name)
        except (OSError, ValueError) as exc:
            request.error = exc
        self.input = channel
        request.done.set()
        return channel

    def release(self, seq_ids: list[int]) -> int:
        with self._lock:
            for s in seq_ids:
                self.cache.free(s)
            self._update_gauges()
            return self.cache.num_free_blocks

    def _update_gauges(self) -> None:
        a = self.cache.allocator
        KV_BLOCKS.labels("free").set(a.num_free)
        KV_BLOCKS.labels("used").set(a.num_blocks - a.num_free)
        KV_USAGE.set(self.cache.usage())

    def _run(self) -> None:
        channel: TensorChannel | None = None
        while not self._stop.is_set():
            channel = self._take_reconnect(channel)
            if channel is None:
                with self._connected:
                    if self._reconnect is None and not self._stop.is_set():
                        self._connected.wait(0.5)
                continue
            t0 = time.perf_counter()
            try:
                meta, tensors = channel.recv(timeout=1.0)
            except ChannelTimeoutError:
                continue
            except (PeerDiedError, ChannelClosedError) as exc:
                self.log.warning("input_lost", error=str(exc))
                channel.close()
                channel = self.input = None
                continue
            SHM_WAIT.inc(time.perf_counter() - t0)
            HANDOFFS.labels("in").inc()
            HANDOFF_LATENCY.labels("in").inc(channel.last_latency_ns / 1e9)
            HANDOFF_WORK.labels("in").inc(channel.last_work_ns / 1e9)
            if meta.get("sn", self.session) != self.session:  # left over from before a restart
                channel.release()
                self.log.warning("stale_handoff_dropped", step=meta.get("s"), layer=meta.get("l"))
                continue
            reply, out = self._handle(meta, tensors)
            channel.release()
            try:
                self.output.send(reply, out, timeout=30.0)
                HANDOFFS.labels("out").inc()
                HANDOFF_WORK.labels("out").inc(self.output.last_work_ns / 1e9)
            except (PeerDiedError, ChannelClosedError, ChannelTimeoutError) as exc:
                self.log.warning("output_lost", error=str(exc))

    def _handle(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        key = (meta["s"], meta["m"])
        layer = meta["l"]
        reply = {"s": meta["s"], "l": layer, "m": meta["m"], "sn": meta.get("sn", self.session)}
        t0 = time.perf_counter_ns()
        try:
            if layer == 0:
                self._batches[key] = self._begin(meta)
            mb = self._batches.get(key)
            if mb is None:
                raise LookupError(f"step {meta['s']} micro-batch {meta['m']} was never started at layer 0")
            q, k, v = tensors
            cache_dtype = self.cache.k.dtype  # fp32 on the host: bf16 matmuls are slow (emulated) on CPUs
            with self._lock:
                write_kv(self.cache.k[layer], self.cache.v[layer], k.to(cache_dtype), v.to(cache_dtype), mb.write_slots)
                out = paged_attention(q.to(cache_dtype), self.cache.k[layer], self.cache.v[layer], mb).to(q.dtype)
            self.timeline.record("cpu", "attention", meta["s"], layer, meta["m"], t0)
            if layer == self.spec.num_layers - 1:
                del self._batches[key]
        except KVCacheFullError as exc:
            return self._error(reply, key, "RESOURCE_EXHAUSTED", str(exc))
        except (LookupError, ValueError) as exc:
            return self._error(reply, key, "FAILED_PRECONDITION", str(exc))
        BUSY.labels("prefill_attention" if not mb.meta.is_decode else "decode_attention").inc(
            (time.perf_counter_ns() - t0) / 1e9
        )
        return reply, [out]

    def _error(self, reply: dict, key: tuple[int, int], code: str, message: str) -> tuple[dict, list[torch.Tensor]]:
        self._batches.pop(key, None)
        ERRORS.labels(code).inc()
        self.log.warning("attention_error", code=code, error=message)
        return {**reply, "error": message, "code": code}, []

    def _begin(self, meta: dict) -> AttentionPlan:
        seqs, q_lens, starts = meta["seqs"], meta["q"], meta["p"]
        with self._lock:
            md = self.cache.begin(seqs, q_lens, starts)
            self._update_gauges()
        return plan_attention(md, self.spec.sliding_window)

    def stop(self) -> None:
        self._stop.set()
        with self._connected:
            self._connected.notify_all()
        self._thread.join(timeout=5)
        if self.input is not None:
            self.input.close()
        self.output.close()
        self.kv_segment.close()
        self.kv_segment.unlink()
        self.timeline.close()
