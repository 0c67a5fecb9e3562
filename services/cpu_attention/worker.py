"""The attention loop: q/k/v in from the expert service, attention out, KV kept in shared memory."""

from __future__ import annotations

import threading
import time

import grpc
import structlog
import torch
from prometheus_client import Counter, Gauge

from moe_lightning.handoff import (
    RELEASE_LAYER,
    AttentionHandoff,
    HandoffHeader,
    QKVHandoff,
    ReleaseHandoff,
    SequenceBatch,
    decode_expert_message,
)
from moe_lightning.kv_cache import KVCacheFullError, PagedKVCache
from moe_lightning.service.metrics import HANDOFF_LATENCY, HANDOFF_WORK, HANDOFFS, KV_USAGE, SHM_WAIT
from moe_lightning.service.metrics import STAGE_BUSY as BUSY
from moe_lightning.shm.channel import ChannelClosedError, ChannelTimeoutError, PeerDiedError, TensorChannel
from moe_lightning.shm.segment import Segment, segment_name
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.attend import BatchPlans, attend, plan_batch
from moe_lightning.timeline import TimelineRecorder

KV_HINT = "free space in /dev/shm or pass a smaller --kv-cache-memory"
KV_BLOCKS = Gauge("moe_lightning_kv_cache_blocks", "KV cache blocks", ["state"])
ERRORS = Counter("moe_lightning_attention_errors_total", "Attention requests answered with an error", ["code"])
for _code in ("RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "INTERNAL"):  # the codes _handle answers with
    ERRORS.labels(_code)  # exported at 0 from the start: an error panel shows a rate of 0, not "no data"


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
        kv_dtype: torch.dtype | str = torch.float32,
        sinks: list[torch.Tensor | None] | None = None,
    ) -> None:
        """`kv_dtype`: the cache's kv_format (a float dtype or its name, or "int8": values and their scales
        both in the shared-memory segment). `sinks`: each layer's sink logits (H,) (GPT-OSS's, read from
        the weight store's arena)."""
        self.spec = spec
        self.sinks = sinks or [None] * spec.num_layers
        self.timeline = timeline or TimelineRecorder(None, "cpu_attention")
        self.log = structlog.get_logger()
        nbytes = PagedKVCache.storage_bytes(spec, num_blocks, block_size, kv_dtype)
        # committed now, every page (shm/pages.py): a /dev/shm filled later cannot take them back
        self.kv_segment = Segment.create(segment_name(run_id, "cpu_attention", "kv"), nbytes, "the KV cache", KV_HINT)
        storage = PagedKVCache.storage_in(self.kv_segment.tensor, spec, num_blocks, block_size, kv_dtype)
        self.cache = PagedKVCache(spec, num_blocks, block_size, kv_dtype, storage=storage)
        try:
            self.output = TensorChannel.create(segment_name(run_id, "cpu_attention", "attn"), slots, slot_bytes)
        except BaseException:  # no stop() will run for a worker never made: its cache must not stay behind
            self.kv_segment.close()
            self.kv_segment.unlink()
            raise
        self.input: TensorChannel | None = None  # owned by the loop thread (see _take_reconnect)
        self._reconnect: _Reconnect | None = None
        self._lock = threading.Lock()  # guards the cache between the loop and connect()
        self._connected = threading.Condition()
        self._stop = threading.Event()
        self._batches: dict[tuple[int, int], BatchPlans] = {}
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
        except Exception as exc:  # whatever it is, connect() reports it (and the loop keeps no closed handle)
            request.error = exc
        self.input = channel
        request.done.set()
        return channel

    def _release(self, seq_ids: list[int]) -> None:
        with self._lock:
            for s in seq_ids:
                self.cache.free(s)
            self._update_gauges()

    def _update_gauges(self) -> None:
        a = self.cache.allocator
        KV_BLOCKS.labels("free").set(a.num_free)
        KV_BLOCKS.labels("used").set(a.num_blocks - a.num_free)
        KV_USAGE.set(self.cache.usage())

    def _run(self) -> None:
        channel: TensorChannel | None = None
        while not self._stop.is_set():
            try:
                channel = self._turn(channel)
            except Exception:  # never end the loop (issue 14, item 8): the next hand-off may be served
                self.log.exception("attention_loop_error")
                channel = self.input  # _take_reconnect and input_lost keep the two in step
                self._stop.wait(0.1)  # a fault that repeats must not spin

    def _turn(self, channel: TensorChannel | None) -> TensorChannel | None:
        """One hand-off in, its answer out; returns the input channel for the next turn."""
        channel = self._take_reconnect(channel)
        if channel is None:
            with self._connected:
                if self._reconnect is None and not self._stop.is_set():
                    self._connected.wait(0.5)
            return None
        t0 = time.perf_counter()
        try:
            meta, tensors = channel.recv(timeout=1.0)
        except ChannelTimeoutError:
            return channel
        except (PeerDiedError, ChannelClosedError) as exc:
            self.log.warning("input_lost", error=str(exc))
            channel.close()
            self.input = None
            return None
        SHM_WAIT.inc(time.perf_counter() - t0)
        try:
            reply = self._serve(channel, meta, tensors)
        except Exception as exc:  # whatever it was, gpu_expert waits for this answer: give it one
            reply = self._crashed(meta, exc)
        finally:
            channel.release()  # idempotent: the slot goes back whatever happened
        if reply is None:
            return channel
        try:
            self.output.send(reply.meta(), reply.tensors(), timeout=30.0)
            HANDOFFS.labels("out").inc()
            HANDOFF_WORK.labels("out").inc(self.output.last_work_ns / 1e9)
        except (PeerDiedError, ChannelClosedError, ChannelTimeoutError) as exc:
            self.log.warning("output_lost", error=str(exc))
        return channel

    def _serve(self, channel: TensorChannel, meta: bytes, tensors: list[torch.Tensor]) -> AttentionHandoff | None:
        """The answer to one received hand-off (None: it needs none)."""
        HANDOFFS.labels("in").inc()
        HANDOFF_LATENCY.labels("in").inc(channel.last_latency_ns / 1e9)
        HANDOFF_WORK.labels("in").inc(channel.last_work_ns / 1e9)
        msg = decode_expert_message(meta, tensors)
        if msg.header.session != self.session:  # left over from before a restart
            self.log.warning("stale_handoff_dropped", step=msg.header.step, layer=msg.header.layer)
            return None
        if isinstance(msg, ReleaseHandoff):  # finished sequences, ahead of the step's first q/k/v
            self._release(msg.seq_ids)
            return None
        return self._handle(msg)

    def _crashed(self, meta: bytes, exc: Exception) -> AttentionHandoff | None:
        """An INTERNAL answer to a hand-off that raised what _handle does not expect; None when the
        hand-off needs no answer (a release, another session's) or its header cannot be read."""
        self.log.exception("attention_handoff_crashed")
        try:
            header = HandoffHeader.unpack(meta)
        except Exception:  # nothing to address an answer to: gpu_expert's wait for it times out
            return None
        if header.layer == RELEASE_LAYER or header.session != self.session:
            return None
        key = (header.step, header.micro_batch)
        return self._error(header, key, grpc.StatusCode.INTERNAL, f"internal error in attention: {exc!r}")

    def _handle(self, msg: QKVHandoff) -> AttentionHandoff:
        h = msg.header
        key = (h.step, h.micro_batch)
        layer = h.layer
        t0 = time.perf_counter_ns()
        try:
            msg.check(self.spec)  # before the cache sees it: a malformed message fails alone
            if layer == 0:
                if msg.batch is None:
                    raise LookupError(f"step {h.step} micro-batch {h.micro_batch} came without its sequences")
                self._batches[key] = self._begin(msg.batch)
            mb = self._batches.get(key)
            if mb is None:
                raise LookupError(f"step {h.step} micro-batch {h.micro_batch} was never started at layer 0")
            q, k, v = msg.q, msg.k, msg.v
            with self._lock:  # K/V stored in the cache's format (--kv-dtype); attention computes in fp32
                kc, vc = self.cache.layer(layer)
                out = attend(self.spec, q, k, v, kc, vc, mb[layer], self.sinks[layer])  # in q's dtype
            self.timeline.record("cpu", "attention", h.step, layer, h.micro_batch, t0)
            if layer == self.spec.num_layers - 1:
                del self._batches[key]
        except KVCacheFullError as exc:
            return self._error(h, key, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (LookupError, ValueError) as exc:
            return self._error(h, key, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # a bug (or torch) raising something else: this hand-off fails, not the loop
            self.log.exception("attention_handoff_crashed")
            return self._error(h, key, grpc.StatusCode.INTERNAL, f"internal error in attention: {exc!r}")
        busy = time.perf_counter_ns() - t0
        BUSY.labels("prefill_attention" if not mb.meta.is_decode else "decode_attention").inc(busy / 1e9)
        return AttentionHandoff(h, out, busy_ns=busy)

    def _error(
        self, header: HandoffHeader, key: tuple[int, int], code: grpc.StatusCode, message: str
    ) -> AttentionHandoff:
        self._batches.pop(key, None)
        ERRORS.labels(code.name).inc()
        self.log.warning("attention_error", code=code.name, error=message)
        return AttentionHandoff.failed(header, code, message)

    def _begin(self, batch: SequenceBatch) -> BatchPlans:
        with self._lock:
            md = self.cache.begin(batch.seq_ids, batch.q_lens, batch.starts)
            self._update_gauges()
        return plan_batch(self.spec, md)

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
