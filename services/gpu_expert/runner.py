"""Runs a step's stages on the device: pre-attention, hand-off to attention, post-attention, head.

The weights are views into the weight store's arena (zero-copy when the device is the CPU, one
copy onto an accelerator). Sampler state (each sequence's random stream) lives here between steps.
The micro-batches go through the layers in CGOPipe's order (`schedule.py`), or one at a time in
the overlap-off baseline; with attention placed on the device there are no hand-offs at all.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
import torch
from prometheus_client import Counter

from moe_lightning.handoff import HandoffHeader, QKVHandoff, SequenceBatch, pipeline_window
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.placement import Side
from moe_lightning.plan import SequenceWork, StepKind, StepOutput, StepPlan, StepTimings
from moe_lightning.sampling import SamplingParams, sample, token_logprobs
from moe_lightning.service.errors import NotReadyError, OutOfMemoryError, ServiceError, is_out_of_memory
from moe_lightning.service.metrics import SHM_WAIT
from moe_lightning.service.metrics import STAGE_BUSY as BUSY
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import embed_tokens, head_logits, post_attention, pre_attention
from moe_lightning.stages.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights
from services.gpu_expert.clock import StageClock
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.residency import plan_residency
from services.gpu_expert.routing import EXPORT_EVERY, RoutingCounts
from services.gpu_expert.schedule import SEND, cgopipe_order, sequential_order

STEPS = Counter("moe_lightning_steps_total", "Steps run", ["kind"])
RESIDENCY_CHANGES = Counter("moe_lightning_residency_changes_total", "Hot-expert residency updates")
TOKENS = Counter("moe_lightning_sampled_tokens_total", "Tokens sampled by the head")
SYNCS = Counter("moe_lightning_cuda_syncs_total", "Host synchronisations with the device (--count-syncs)", ["kind"])
OOMS = Counter("moe_lightning_step_out_of_memory_total", "Steps that ran out of memory")


@dataclass(slots=True)
class _MicroBatchState:
    works: list[SequenceWork]
    positions: torch.Tensor  # (T,)
    hidden: torch.Tensor  # (T, D)
    last_rows: torch.Tensor  # (B,)
    attention: AttentionPlan | None = None  # set when attention runs here, over the device KV cache


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto the device without blocking the host (pinned, then async)."""
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values


class ExpertRunner:
    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        device: torch.device,
        link: HandoffLink,
        pager: ExpertPager | None = None,
        kv: PagedKVCache | None = None,
        residency_interval: int = 0,
        timeline: TimelineRecorder | None = None,
        overlap: bool = True,
        count_syncs: bool = False,
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.device = device
        self.link = link
        self.pager = pager
        self.kv = kv  # the device KV cache (attention placed on the device); None: attention service only
        self.connected = False
        self.samplers: dict[int, tuple[SamplingParams, torch.Generator | None]] = {}
        self.log = structlog.get_logger()
        self.residency_interval = residency_interval
        self.overlap = overlap
        self.count_syncs = count_syncs and device.type == "cuda"
        self._pages_for: Side | None = None  # the experts placement the pager's prefetched pages serve
        self._unsent_release: list[int] = []  # finished sequences cpu_attention has not been told of
        self.clock = StageClock(device, timeline or TimelineRecorder(None, "gpu_expert"))
        self.routing = RoutingCounts(spec.num_layers, spec.num_experts, device)
        self._decode_steps = 0

    def connect(self, input_channel: str, session: int = 0) -> None:
        """Wires the attention channel and starts a new session (see the attention worker's connect):
        sampler streams, the device KV cache and prefetched pages of earlier requests are dropped."""
        self.samplers.clear()
        self._unsent_release.clear()
        if self.kv is not None:
            self.kv.reset()
        if self.pager is not None:
            self.pager.reset()
        self.link.connect(input_channel, session)  # stamped on every hand-off; replies of another session are stale
        self.connected = True
        self.log.info("input_connected", channel=input_channel)

    def _prepare(self, plan: StepPlan) -> list[_MicroBatchState]:
        for seq in plan.release:
            self.samplers.pop(seq, None)
            if self.kv is not None:
                self.kv.free(seq)
        if not plan.placement.attention_on_device:  # kept until sent: a step that fails first must not lose them
            self._unsent_release.extend(plan.release)
        if plan.placement.attention_on_device and self.kv is None:
            raise ServiceError(
                "attention on the device was asked for, but this gpu_expert has no device KV cache "
                "(start it with --device-kv-memory)",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if self.pager is not None and plan.placement.experts != self._pages_for:
            self.pager.reset()  # placement changed: pages prefetched for the old one are dropped
        self._pages_for = plan.placement.experts
        states = []
        for mb in plan.micro_batches:
            if not mb:
                raise ServiceError("a micro-batch is empty", grpc.StatusCode.INVALID_ARGUMENT)
            for w in mb:
                if w.sampling is not None:
                    self.samplers[w.seq_id] = (w.sampling, w.sampling.make_generator(self.device))
                elif w.seq_id not in self.samplers:
                    raise ServiceError(
                        f"sequence {w.seq_id} is unknown here: its first step must carry sampling parameters",
                        grpc.StatusCode.FAILED_PRECONDITION,
                    )
                if not w.token_ids:
                    raise ServiceError(f"sequence {w.seq_id} has no new tokens", grpc.StatusCode.INVALID_ARGUMENT)
            tokens = _to_device(torch.tensor([t for w in mb for t in w.token_ids], dtype=torch.long), self.device)
            positions = torch.cat([torch.arange(w.start, w.start + len(w.token_ids)) for w in mb])
            last = torch.tensor([len(w.token_ids) for w in mb]).cumsum(0) - 1
            st = _MicroBatchState(
                mb,
                _to_device(positions, self.device),
                embed_tokens(self.weights.embed, tokens),
                _to_device(last, self.device),
            )
            if plan.placement.attention_on_device:
                assert self.kv is not None
                try:
                    md = self.kv.begin([w.seq_id for w in mb], [len(w.token_ids) for w in mb], [w.start for w in mb])
                except ValueError as exc:
                    raise ServiceError(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from exc
                st.attention = plan_attention(md, self.spec.sliding_window, device=self.device)
            states.append(st)
        return states

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        if not self.connected and not plan.placement.attention_on_device:
            raise NotReadyError("gpu_expert is not connected to an attention service yet")
        if not plan.micro_batches:  # release only: the orchestrator went idle with sequences finished
            self._prepare(plan)
            self._send_release(plan)
            return StepOutput([], [], StepTimings(plan.kind))
        if not self.count_syncs:
            return self._step(plan)
        with warnings.catch_warnings(record=True) as caught:  # set_sync_debug_mode warns once per sync
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = self._step(plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        SYNCS.labels(plan.kind).inc(sum("synchroniz" in str(w.message) for w in caught))
        return out

    def _step(self, plan: StepPlan) -> StepOutput:
        t_start = time.perf_counter_ns()
        timings = StepTimings(plan.kind)
        self.clock.begin_step()
        waited = self.pager.wait_seconds if self.pager is not None else 0.0
        try:
            states = self._prepare(plan)
            if plan.placement.attention_on_device:
                self._run_with_local_attention(plan, states)
            else:
                self._run_pipeline(plan, states, timings)
            t0 = self.clock.mark()
            hidden = torch.cat([st.hidden[st.last_rows] for st in states])  # (B, D)
            logits = head_logits(self.spec, self.weights.final_norm, self.weights.lm_head, hidden)  # (B, V)
            works = [w for st in states for w in st.works]
            chosen = [self.samplers[w.seq_id] for w in works]
            tokens = sample(logits, [c[0] for c in chosen], [c[1] for c in chosen]).tolist()
            logprobs = {
                w.seq_id: token_logprobs(logits[b], tokens[b], c[0].logprobs)
                for b, (w, c) in enumerate(zip(works, chosen, strict=True))
                if c[0].logprobs
            }
            self.clock.span("head", "head", -1, -1, t0, self.clock.mark())
            # after the sampled tokens reached the host: the step's events have all completed, so the
            # device-side expert waits are known without waiting for anything
            if self.pager is not None:
                self.pager.end_step()
            self.link.end_step()
        except BaseException as exc:
            self._recover()
            if is_out_of_memory(exc):
                OOMS.inc()
                raise OutOfMemoryError(
                    f"the step ({plan.num_sequences} sequences, {plan.num_tokens} tokens) ran out of memory on "
                    f"{self.device}: {str(exc).splitlines()[0]}; retry with fewer or shorter requests"
                ) from exc
            raise
        for stage, ns in self.clock.finish(plan.step_id).items():
            timings.add(stage, ns)
        if self.pager is not None:
            timings.expert_wait = int((self.pager.wait_seconds - waited) * 1e9)
        timings.step = time.perf_counter_ns() - t_start
        for stage in ("pre_attention", "post_attention", "head"):
            BUSY.labels(stage).inc(getattr(timings, stage) / 1e9)
        SHM_WAIT.inc(timings.attention_wait / 1e9)
        STEPS.labels(plan.kind).inc()
        TOKENS.inc(len(tokens))
        if plan.kind is StepKind.DECODE:
            self._after_decode_step()
        return StepOutput([w.seq_id for w in works], tokens, timings, logprobs)

    def _recover(self) -> None:
        """After a failed step: consume the results still owed, drop prefetched pages and free the
        device's cached blocks (an out-of-memory step must not leave the next one short)."""
        self.link.drain()
        if self.pager is not None:
            self.pager.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- schedules ------------------------------------------------------------------------------
    def _run_pipeline(self, plan: StepPlan, states: list[_MicroBatchState], timings: StepTimings) -> None:
        self._send_release(plan)  # ahead of layer 0, which may start new sequences in the freed blocks
        n_ub = len(states)
        layers = self.spec.num_layers
        if self.overlap:
            order = cgopipe_order(layers, n_ub, pipeline_window(n_ub, *self.link.slots))
        else:
            order = sequential_order(layers, n_ub)
        experts: Sequence[ExpertWeights] | None = None
        for op in order:
            layer, m = self.weights.layers[op.layer], op.micro_batch
            if op.kind == SEND:
                if not self.overlap and m == 0:  # the baseline copies a layer's experts before it starts
                    experts = self._begin_layer(plan, op.layer)
                self._send(plan, op.layer, layer, m, states[m], timings)
                continue
            if self.overlap and m == 0:
                experts = self._begin_layer(plan, op.layer)
                self._prefetch(plan, op.layer + 1, 0, n_ub)
            self._receive(plan, op.layer, layer, m, states[m], experts, timings)
            self._prefetch(plan, op.layer + 1, m + 1, n_ub)
            if m == n_ub - 1:
                self._end_layer(plan, op.layer)

    def _send_release(self, plan: StepPlan) -> None:
        if self._unsent_release and not plan.placement.attention_on_device:
            self.link.send_release(plan.step_id, self._unsent_release)
            self._unsent_release = []

    def _run_with_local_attention(self, plan: StepPlan, states: list[_MicroBatchState]) -> None:
        """No hand-offs: the pages of the next layer still interleave with the micro-batches."""
        for layer_idx, layer in enumerate(self.weights.layers):
            experts = self._begin_layer(plan, layer_idx)
            self._prefetch(plan, layer_idx + 1, 0, len(states))
            for m, st in enumerate(states):
                self._attend_here(plan, layer_idx, layer, m, st, experts)
                self._prefetch(plan, layer_idx + 1, m + 1, len(states))
            self._end_layer(plan, layer_idx)

    # ---- stages ---------------------------------------------------------------------------------
    def _send(
        self, plan: StepPlan, layer_idx: int, layer: LayerWeights, m: int, st: _MicroBatchState, timings: StepTimings
    ) -> None:
        t0 = self.clock.mark()
        q, k, v = pre_attention(self.spec, layer, st.hidden, st.positions)
        self.clock.span("pre_attention", "pre_attention", layer_idx, m, t0, self.clock.mark())
        h0 = time.perf_counter_ns()
        batch = None
        if layer_idx == 0:
            batch = SequenceBatch(
                [w.seq_id for w in st.works], [len(w.token_ids) for w in st.works], [w.start for w in st.works]
            )
        header = HandoffHeader(plan.step_id, layer_idx, m, self.link.session)
        self.link.send(QKVHandoff(header, q, k, v, batch))
        timings.handoff_send += time.perf_counter_ns() - h0

    def _receive(
        self,
        plan: StepPlan,
        layer_idx: int,
        layer: LayerWeights,
        m: int,
        st: _MicroBatchState,
        experts: Sequence[ExpertWeights] | None,
        timings: StepTimings,
    ) -> None:
        h0 = time.perf_counter_ns()
        attn = self.link.receive(plan.step_id, layer_idx, m)
        timings.attention_wait += time.perf_counter_ns() - h0
        t0 = self.clock.mark()
        self._post_attention(layer_idx, layer, st, attn, experts)
        self.clock.span("post_attention", "post_attention", layer_idx, m, t0, self.clock.mark())
        self.link.done_with_input()

    def _post_attention(
        self,
        layer_idx: int,
        layer: LayerWeights,
        st: _MicroBatchState,
        attn: torch.Tensor,
        experts: Sequence[ExpertWeights] | None,
    ) -> None:
        """The stage after attention, wherever attention ran; routing is counted for hot-expert
        residency (a dense layer routes nothing)."""
        st.hidden, counts = post_attention(self.spec, layer, st.hidden, attn, experts)
        self.routing.add(layer_idx, counts)

    def _attend_here(
        self,
        plan: StepPlan,
        layer_idx: int,
        layer: LayerWeights,
        m: int,
        st: _MicroBatchState,
        experts: Sequence[ExpertWeights] | None,
    ) -> None:
        assert self.kv is not None and st.attention is not None
        t0 = self.clock.mark()
        q, k, v = pre_attention(self.spec, layer, st.hidden, st.positions)
        t1 = self.clock.mark()
        write_kv(self.kv.k[layer_idx], self.kv.v[layer_idx], k, v, st.attention.write_slots)
        attn = paged_attention(q, self.kv.k[layer_idx], self.kv.v[layer_idx], st.attention)
        t2 = self.clock.mark()
        self._post_attention(layer_idx, layer, st, attn, experts)
        t3 = self.clock.mark()
        self.clock.span("pre_attention", "pre_attention", layer_idx, m, t0, t1)
        self.clock.span("device_attention", "attention", layer_idx, m, t1, t2)
        self.clock.span("post_attention", "post_attention", layer_idx, m, t2, t3)

    # ---- streamed experts -----------------------------------------------------------------------
    def _begin_layer(self, plan: StepPlan, layer_idx: int) -> Sequence[ExpertWeights] | None:
        if self.pager is None:
            return None
        if plan.placement.experts_on_host:  # non-resident experts compute where they live: no transfer
            resident = self.pager.resident[layer_idx]
            host = self.weights.layers[layer_idx].experts
            return [resident.get(e) or host[e] for e in range(len(host))]
        return self.pager.begin_layer(layer_idx)

    def _prefetch(self, plan: StepPlan, layer_idx: int, page: int, num_pages: int) -> None:
        if self.pager is not None and not plan.placement.experts_on_host:
            self.pager.prefetch_page(layer_idx, page, num_pages)

    def _end_layer(self, plan: StepPlan, layer_idx: int) -> None:
        if self.pager is not None and not plan.placement.experts_on_host:
            self.pager.end_layer(layer_idx)

    # ---- hot-expert residency -------------------------------------------------------------------
    def _after_decode_step(self) -> None:
        self._decode_steps += 1
        if self._decode_steps % EXPORT_EVERY == 0:
            self.routing.export()
        if self.residency_interval and self._decode_steps % self.residency_interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        """Between steps: keep the experts that routing uses most resident (hot-expert residency)."""
        pager = self.pager
        if pager is None or pager.plan.max_streamed == 0:
            return
        p = pager.plan
        new = plan_residency(
            self.spec.num_layers,
            self.spec.num_experts,
            p.expert_bytes,
            p.dense_bytes,
            p.budget,
            hot=self.routing.ranking(),
            stream=p.ring_slots > 0,
            dense_layers=self.spec.dense_layers,
        )
        if new.resident != p.resident and new.ring_slots == p.ring_slots:
            moved = sum(len(set(a) ^ set(b)) for a, b in zip(new.resident, p.resident, strict=True)) // 2
            pager.update_residency(new)
            RESIDENCY_CHANGES.inc()
            self.log.info("residency_updated", experts_swapped=moved, after_decode_steps=self._decode_steps)
        self.routing.decay()
