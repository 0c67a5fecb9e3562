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

import grpc
import structlog
import torch
from prometheus_client import Counter

from moe_lightning.handoff import HandoffHeader, QKVHandoff, SequenceBatch, pipeline_window
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.placement import Side
from moe_lightning.plan import RankStep, SequenceWork, StepKind, StepOutput, StepPlan, StepTimings
from moe_lightning.sampling import SamplingParams, sample, token_logprobs
from moe_lightning.service.errors import NotReadyError, OutOfMemoryError, ServiceError, is_out_of_memory
from moe_lightning.service.metrics import SHM_WAIT
from moe_lightning.service.metrics import STAGE_BUSY as BUSY
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import head_logits, post_attention, pre_attention
from moe_lightning.stages.attention import paged_attention, plan_attention, write_kv
from moe_lightning.stages.post_attention import Reduce
from moe_lightning.tensor_parallel import SOLO, Shard, rank_spec
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights
from services.gpu_expert.clock import StageClock
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.hot_experts import HotExperts
from services.gpu_expert.micro_batch import MicroBatchState, check_micro_batch
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.ranks import RankGroup, RankGroupError
from services.gpu_expert.routing import RoutingCounts
from services.gpu_expert.schedule import SEND, cgopipe_order, sequential_order

STEPS = Counter("moe_lightning_steps_total", "Steps run", ["kind"])
TOKENS = Counter("moe_lightning_sampled_tokens_total", "Tokens sampled by the head")
SYNCS = Counter("moe_lightning_cuda_syncs_total", "Host synchronisations with the device (--count-syncs)", ["kind"])
OOMS = Counter("moe_lightning_step_out_of_memory_total", "Steps that ran out of memory")


class ExpertRunner:
    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        device: torch.device,
        link: HandoffLink | None,
        pager: ExpertPager | None = None,
        kv: PagedKVCache | None = None,
        residency_interval: int = 0,
        timeline: TimelineRecorder | None = None,
        overlap: bool = True,
        count_syncs: bool = False,
        shard: Shard = SOLO,
        group: RankGroup | None = None,
    ) -> None:
        """`link`: the hand-off channels to cpu_attention (None on a rank other than 0: rank 0 talks
        to it for the group). `spec` is the whole model; a rank runs its part (`rank_spec`)."""
        self.shard, self.group = shard, group
        self.spec = rank_spec(spec, shard)
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
        self.hot = HotExperts(self.spec, pager, residency_interval, self.routing)
        self.rank_slots = (1, 1)  # a rank other than 0: rank 0's channels' slots (connect_rank)
        self.reduce: Reduce = group.all_reduce if group is not None else (lambda t: t)

    def connect(self, input_channel: str, session: int = 0) -> None:
        """Wires the attention channel and starts a new session (see the attention worker's connect):
        sampler streams, the device KV cache and prefetched pages of earlier requests are dropped."""
        self.samplers.clear()
        self._unsent_release.clear()
        if self.kv is not None:
            self.kv.reset()
        if self.pager is not None:
            self.pager.reset()
        if self.link is None:  # a rank other than 0: rank 0 holds the channels
            raise RuntimeError("connect_rank: only rank 0 connects to the attention service")
        self.link.connect(input_channel, session)  # stamped on every hand-off; replies of another session are stale
        self.connected = True
        self.log.info("input_connected", channel=input_channel)

    def connect_rank(self, slots: tuple[int, int]) -> None:
        """A rank other than 0, when rank 0 connected: the same new session, and the channels' slot
        counts, which set the CGOPipe order every rank must follow alike."""
        self.samplers.clear()
        if self.kv is not None:
            self.kv.reset()
        if self.pager is not None:
            self.pager.reset()
        self.rank_slots = slots
        self.connected = True

    def _prepare(self, plan: StepPlan) -> list[MicroBatchState]:
        for seq in plan.release:
            self.samplers.pop(seq, None)
            if self.kv is not None:
                self.kv.free(seq)
        if not plan.placement.attention_on_device and self.link is not None:  # kept until sent: a step that
            self._unsent_release.extend(plan.release)  # fails first must not lose them
        if plan.placement.attention_on_device and self.kv is None:
            raise ServiceError(
                "attention on the device was asked for, but this gpu_expert has no device KV cache "
                "(start it with --device-kv-memory)",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if self.pager is not None and plan.placement.experts != self._pages_for:
            self.pager.reset()  # placement changed: pages prefetched for the old one are dropped
        self._pages_for = plan.placement.experts
        return [self._micro_batch(mb, plan.placement.attention_on_device) for mb in plan.micro_batches]

    def _micro_batch(self, mb: list[SequenceWork], attention_here: bool) -> MicroBatchState:
        check_micro_batch(mb, self.samplers)
        for w in mb:
            if w.sampling is not None:
                self.samplers[w.seq_id] = (w.sampling, w.sampling.make_generator(self.device))
        st = MicroBatchState.embed(mb, self.weights.embed, self.device)
        if attention_here:
            assert self.kv is not None
            try:
                md = self.kv.begin([w.seq_id for w in mb], [len(w.token_ids) for w in mb], [w.start for w in mb])
            except ValueError as exc:
                raise ServiceError(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from exc
            st.attention = plan_attention(md, self.spec.sliding_window, device=self.device)
        return st

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
        streamed = self.pager.bytes_streamed if self.pager is not None else 0
        prepared = False
        if self.group is not None:
            self.group.take_collective_ns()  # a rank's wait for this step is not the step's
        try:
            states = self._prepare(plan) if self.group is None else self.group.together(lambda: self._prepare(plan))
            prepared = True  # from here on a failure leaves the ranks out of step
            if plan.placement.attention_on_device:
                self._run_with_local_attention(plan, states)
            else:
                self._run_pipeline(plan, states, timings)
            works = [w for st in states for w in st.works]
            tokens, logprobs = self._head(states, works) if self.shard.leads else ([], {})
            # after the sampled tokens reached the host: the step's events have all completed, so the
            # device-side expert waits are known without waiting for anything
            if self.pager is not None:
                self.pager.end_step()
            if self.link is not None:
                self.link.end_step()
        except BaseException as exc:
            self._recover()
            if self.group is not None and prepared and not isinstance(exc, RankGroupError):
                where = f"rank {self.shard.rank} failed mid-step"
                raise RankGroupError(f"{where}, the ranks are out of step: {exc}") from exc
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
        ranks = []
        if self.group is not None:
            timings.collectives = self.group.take_collective_ns()
            mine = self.pager.bytes_streamed - streamed if self.pager is not None else 0
            ranks = self.group.gather_stats(
                RankStep(self.shard.rank, mine, timings.expert_wait, timings.collectives, timings.step)
            )
        for stage in ("pre_attention", "post_attention", "head"):
            BUSY.labels(stage).inc(getattr(timings, stage) / 1e9)
        SHM_WAIT.inc(timings.attention_wait / 1e9)
        STEPS.labels(plan.kind).inc()
        TOKENS.inc(len(tokens))
        if plan.kind is StepKind.DECODE:
            self.hot.after_decode_step()
        return StepOutput([w.seq_id for w in works] if self.shard.leads else [], tokens, timings, logprobs, ranks)

    def _head(self, states: list[MicroBatchState], works: list[SequenceWork]) -> tuple[list[int], dict]:
        """Rank 0's: the logits of each sequence's last row, its sampled token and log-probabilities."""
        t0 = self.clock.mark()
        hidden = torch.cat([st.hidden[st.last_rows] for st in states])  # (B, D)
        logits = head_logits(self.spec, self.weights.final_norm, self.weights.lm_head, hidden)  # (B, V)
        chosen = [self.samplers[w.seq_id] for w in works]
        tokens = sample(logits, [c[0] for c in chosen], [c[1] for c in chosen]).tolist()
        logprobs = {
            w.seq_id: token_logprobs(logits[b], tokens[b], c[0].logprobs)
            for b, (w, c) in enumerate(zip(works, chosen, strict=True))
            if c[0].logprobs
        }
        self.clock.span("head", "head", -1, -1, t0, self.clock.mark())
        return tokens, logprobs

    def _recover(self) -> None:
        """After a failed step: consume the results still owed, drop prefetched pages and free the
        device's cached blocks (an out-of-memory step must not leave the next one short)."""
        if self.link is not None:
            self.link.drain()
        if self.pager is not None:
            self.pager.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- schedules ------------------------------------------------------------------------------
    def _run_pipeline(self, plan: StepPlan, states: list[MicroBatchState], timings: StepTimings) -> None:
        self._send_release(plan)  # ahead of layer 0, which may start new sequences in the freed blocks
        n_ub = len(states)
        layers = self.spec.num_layers
        if self.overlap:
            slots = self.link.slots if self.link is not None else self.rank_slots
            order = cgopipe_order(layers, n_ub, pipeline_window(n_ub, *slots))
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
        if self.link is None:
            return
        if self._unsent_release and not plan.placement.attention_on_device:
            self.link.send_release(plan.step_id, self._unsent_release)
            self._unsent_release = []

    def _run_with_local_attention(self, plan: StepPlan, states: list[MicroBatchState]) -> None:
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
        self, plan: StepPlan, layer_idx: int, layer: LayerWeights, m: int, st: MicroBatchState, timings: StepTimings
    ) -> None:
        t0 = self.clock.mark()
        q, k, v = pre_attention(self.spec, layer, st.hidden, st.positions)
        self.clock.span("pre_attention", "pre_attention", layer_idx, m, t0, self.clock.mark())
        if self.group is not None:  # rank 0 sends every rank's heads in one hand-off
            gathered = self.group.gather_qkv(q, k, v)
            if gathered is None:
                return
            q, k, v = gathered
        assert self.link is not None
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
        st: MicroBatchState,
        experts: Sequence[ExpertWeights] | None,
        timings: StepTimings,
    ) -> None:
        h0 = time.perf_counter_ns()
        attn = self.link.receive(plan.step_id, layer_idx, m) if self.link is not None else None
        timings.attention_wait += time.perf_counter_ns() - h0
        if self.group is not None:  # each rank takes its heads of the result
            attn = self.group.scatter_heads(attn, st.hidden.shape[0], st.hidden.dtype)
        assert attn is not None
        t0 = self.clock.mark()
        self._post_attention(layer_idx, layer, st, attn, experts)
        self.clock.span("post_attention", "post_attention", layer_idx, m, t0, self.clock.mark())
        if self.link is not None:
            self.link.done_with_input()

    def _post_attention(
        self,
        layer_idx: int,
        layer: LayerWeights,
        st: MicroBatchState,
        attn: torch.Tensor,
        experts: Sequence[ExpertWeights] | None,
    ) -> None:
        """The stage after attention, wherever attention ran; routing is counted for hot-expert
        residency (a dense layer routes nothing)."""
        st.hidden, counts = post_attention(self.spec, layer, st.hidden, attn, experts, self.reduce)
        self.routing.add(layer_idx, counts)

    def _attend_here(
        self,
        plan: StepPlan,
        layer_idx: int,
        layer: LayerWeights,
        m: int,
        st: MicroBatchState,
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

    def rebalance(self) -> None:
        self.hot.rebalance()
