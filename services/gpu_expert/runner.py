"""Runs a step's stages on the device: pre-attention, hand-off to attention, post-attention, head.

The weights are views into the weight store's arena (zero-copy when the device is the CPU, one
copy onto an accelerator). Sampler state (each sequence's random stream) lives here between steps.

What varies between deployments is a part chosen once at start, as a tensor-parallel model is a
transform of the model rather than a branch in its forward: where the experts come from
(expert_source.py), this rank's side of the hand-off (handoff_side.py), alone or one rank of a
group (step_ranks.py), whether this rank samples (head.py), overlap on or off
(service_attention.py) and whether syncs are counted (sync_count.py). The plan's placement picks
per step where attention runs (service_attention.py or device_attention.py) and how the experts
are got. A step is then the order schedule.py gives (CGOPipe's, the overlap-off baseline's, or
attention in place), op by op.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import structlog
import torch
from prometheus_client import Counter

from moe_lightning.hrm.decode_share import decode_share
from moe_lightning.kv_cache import PagedKVCache
from moe_lightning.placement import Side
from moe_lightning.sampling import SequenceSampler
from moe_lightning.service.errors import OutOfMemoryError, is_out_of_memory
from moe_lightning.service.metrics import SHM_WAIT
from moe_lightning.service.metrics import STAGE_BUSY as BUSY
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import attention_output, ffn, post_attention, pre_attention
from moe_lightning.stages.moe import routes_on_device
from moe_lightning.step_protocol import SequenceWork, StepKind, StepOutput, StepPlan, StepTimings
from moe_lightning.tensor_parallel import SOLO, rank_spec
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.weights import ExpertWeights, ModelWeights
from services.gpu_expert.clock import StageClock
from services.gpu_expert.device_attention import DeviceAttention, NoDeviceAttention, device_attention_part
from services.gpu_expert.expert_source import LayerSource, expert_part, never
from services.gpu_expert.handoff_link import HandoffLink
from services.gpu_expert.handoff_side import handoff_part
from services.gpu_expert.head import Samplers, head_part
from services.gpu_expert.hot_experts import HotExperts
from services.gpu_expert.micro_batch import MicroBatchState, check_micro_batch
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.ranks import RankGroup
from services.gpu_expert.routing import RoutingCounts
from services.gpu_expert.schedule import (
    ATTEND,
    ATTEND_COLLECT,
    BEGIN,
    COLLECT,
    END,
    GROUP_FFN,
    PREFETCH,
    RECEIVE,
    SEND,
    Op,
    capped_groups,
)
from services.gpu_expert.service_attention import ServiceAttention
from services.gpu_expert.step_masks import StepMasks
from services.gpu_expert.step_ranks import rank_part
from services.gpu_expert.sync_count import sync_count_part

STEPS = Counter("moe_lightning_steps_total", "Steps run", ["kind"])
TOKENS = Counter("moe_lightning_sampled_tokens_total", "Tokens sampled by the head")
OOMS = Counter("moe_lightning_step_out_of_memory_total", "Steps that ran out of memory")
# how often the device read a layer's experts: once per micro-batch, or once per group of them
FFN_PASSES = Counter("moe_lightning_expert_ffn_passes_total", "Layer FFN passes run (a micro-batch's, or a group's)")

AttentionPlace = ServiceAttention | DeviceAttention | NoDeviceAttention


@dataclass(slots=True)
class _Step:
    """One step on its way through the order."""

    plan: StepPlan
    states: list[MicroBatchState]
    source: LayerSource  # how this step's layers get their experts
    timings: StepTimings
    experts: Sequence[ExpertWeights] | None = None  # the current layer's, from its BEGIN


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
        group: RankGroup | None = None,
        max_group_tokens: int = 1 << 62,
        routing_on_device: bool | None = None,
        mask_timeout: float = 30.0,
    ) -> None:
        """`link`: the hand-off channels to cpu_attention (None on a rank other than 0: rank 0 talks
        to it for the group). `spec` is the whole model; a rank of `group` runs its part
        (`rank_spec`). `kv`: the device KV cache, for attention placed on the device.
        `max_group_tokens`: the most rows a grouped FFN takes at once (the largest micro-batch the
        device's memory reserve holds activations for, --max-tokens-per-handoff). `routing_on_device`:
        whether a micro-batch's experts may run without reading its routing back where that costs
        nothing (stages/moe.py, routes_on_device); None: on CUDA, where a read-back stalls the host.
        `mask_timeout`: seconds the head waits for the grammar masks that follow a step (step_masks.py)."""
        # as given, for the service and its tests (Describe, Connect, metrics); a step reads only parts
        self.link, self.pager, self.kv, self.group = link, pager, kv, group
        self.shard = group.shard if group is not None else SOLO
        self.spec = rank_spec(spec, self.shard)
        self.weights = weights
        self.device = device
        self.max_group_tokens = max_group_tokens
        self.overlap = overlap
        self.samplers: Samplers = {}
        self.log = structlog.get_logger()
        self.clock = StageClock(device, timeline or TimelineRecorder(None, "gpu_expert"))
        self.routing = RoutingCounts(spec.num_layers, spec.num_experts, device)
        self.hot = HotExperts(self.spec, pager, residency_interval, self.routing)
        # the parts, chosen once
        self.ranks = rank_part(group)
        self.handoff = handoff_part(link, group)
        on_device = device.type == "cuda" if routing_on_device is None else routing_on_device
        rule = partial(routes_on_device, num_experts=self.spec.num_experts, top_k=self.spec.top_k)
        self.experts = expert_part(pager, weights, device, rule if on_device else never)
        self.masks = StepMasks(mask_timeout)
        self.head = head_part(self.shard.leads, self.spec, weights, self.samplers, self.clock, self.masks)
        self.counted: Callable[[StepKind, Callable[[], StepOutput]], StepOutput] = sync_count_part(count_syncs, device)
        self.local = device_attention_part(kv, self.spec, device, [layer.sinks for layer in weights.layers])
        self.places: dict[Side, AttentionPlace] = {
            Side.HOST: ServiceAttention(self.handoff, overlap),
            Side.DEVICE: self.local,
        }
        self.stages: dict[str, Callable[[_Step, Op], None]] = {
            BEGIN: self._begin_layer,
            PREFETCH: self._prefetch,
            SEND: self._send,
            RECEIVE: self._receive,
            COLLECT: self._receive,
            ATTEND: self._attend_here,
            ATTEND_COLLECT: self._attend_here,
            GROUP_FFN: self._group_ffn,
            END: self._end_layer,
        }

    @property
    def connected(self) -> bool:
        return self.handoff.connected

    def connect(self, input_channel: str, session: int = 0) -> None:
        """Wires the attention channel and starts a new session (see the attention worker's connect):
        sampler streams, the device KV cache and prefetched pages of earlier requests are dropped."""
        self.samplers.clear()
        self.masks.reset()
        self.local.reset()
        self.experts.reset()
        self.handoff.connect(input_channel, session)  # refused on a rank other than 0
        self.log.info("input_connected", channel=input_channel)

    def connect_rank(self, slots: tuple[int, int]) -> None:
        """A rank other than 0, when rank 0 connected: the same new session, and the channels' slot
        counts, which set the CGOPipe order every rank must follow alike."""
        self.samplers.clear()
        self.local.reset()
        self.experts.reset()
        self.handoff.connect_rank(slots)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        place = self.places[plan.placement.attention]
        place.check_ready()
        if not plan.micro_batches:  # release only: the orchestrator went idle with sequences finished
            self._prepare(plan, place)
            place.send_release(plan.step_id)
            return StepOutput([], [], StepTimings(plan.kind))
        self.masks.begin(plan.step_id)
        try:
            return self.counted(plan.kind, lambda: self._step(plan, place))
        finally:  # sampled or failed anywhere: its masks' entry goes, a late delivery is dropped
            self.masks.end(plan.step_id)

    def _prepare(self, plan: StepPlan, place: AttentionPlace) -> tuple[list[MicroBatchState], LayerSource]:
        for seq in plan.release:
            self.samplers.pop(seq, None)
        self.local.free(plan.release)
        place.prepare(plan.release)
        source = self.experts.for_step(plan.placement.experts)
        return [self._micro_batch(mb, place) for mb in plan.micro_batches], source

    def _micro_batch(self, mb: list[SequenceWork], place: AttentionPlace) -> MicroBatchState:
        check_micro_batch(mb, self.samplers)
        for w in mb:
            sampler = self.samplers.get(w.seq_id)
            if w.sampling is not None:
                if sampler is None or w.start == 0:
                    sampler = SequenceSampler.start(w.sampling, w.draws, self.device, w.prompt_len)
                    self.samplers[w.seq_id] = sampler
                else:  # the next chunk of a prompt spanning steps: its history and pending prompt row stay
                    sampler.resume(w.draws)
            if sampler is not None:
                sampler.feed(w.start, w.token_ids)
        st = MicroBatchState.embed(mb, self.weights.embed, self.device)
        place.begin(mb, st)
        return st

    def _step(self, plan: StepPlan, place: AttentionPlace) -> StepOutput:
        t_start = time.perf_counter_ns()
        timings = StepTimings(plan.kind)
        self.clock.begin_step()
        waited, streamed, linked = self.experts.counters()
        prepared = False
        self.ranks.begin_step()
        try:
            states, source = self.ranks.together(lambda: self._prepare(plan, place))
            prepared = True  # from here on a failure leaves the ranks out of step
            place.send_release(plan.step_id)
            tokens = [len(st.hidden) for st in states]
            groups = capped_groups(tokens, plan.expert_groups, self.max_group_tokens)
            order = place.order(self.spec.num_layers, len(states), groups)
            self._run(order, _Step(plan, states, source, timings))
            works = [w for st in states for w in st.works]
            tokens, logprobs, prompt_logprobs, faults = self.head.sample(states, works, plan.step_id)
            # after the sampled tokens reached the host: the step's events have all completed, so the
            # device-side expert waits are known without waiting for anything
            self.experts.end_step()
            self.handoff.end_step()
        except BaseException as exc:
            self._recover()
            self.ranks.after_failure(exc, prepared)
            if is_out_of_memory(exc):
                OOMS.inc()
                raise OutOfMemoryError(
                    f"the step ({plan.num_sequences} sequences, {plan.num_tokens} tokens) ran out of memory on "
                    f"{self.device}: {str(exc).splitlines()[0]}; retry with fewer or shorter requests"
                ) from exc
            raise
        for stage, ns in self.clock.finish(plan.step_id).items():
            timings.add(stage, ns)
        waited_now, streamed_now, linked_now = self.experts.counters()
        timings.expert_wait = int((waited_now - waited) * 1e9)
        timings.link_busy = int((linked_now - linked) * 1e9)
        timings.step = time.perf_counter_ns() - t_start
        timings.decode = round(timings.step * self._decode_share(plan, timings))
        ranks = self.ranks.finish(timings, streamed_now - streamed)
        for stage in ("pre_attention", "post_attention", "head"):
            BUSY.labels(stage).inc(getattr(timings, stage) / 1e9)
        SHM_WAIT.inc(timings.attention_wait / 1e9)
        STEPS.labels(plan.kind).inc()
        TOKENS.inc(len(tokens))
        if plan.kind is not StepKind.PREFILL:  # a step that decoded: its routing is the batch's
            self.hot.after_decode_step()
        return StepOutput(self.head.seq_ids(works), tokens, timings, logprobs, ranks, prompt_logprobs, faults)

    def _decode_share(self, plan: StepPlan, t: StepTimings) -> float:
        """The share of the step's time its decode rows are charged with (hrm/decode_share.py), from
        each resource's busy time in it: the link, the device's compute, the host's attention."""
        device = t.pre_attention + max(0, t.post_attention - t.expert_wait) + t.head + t.device_attention
        return decode_share(
            plan.kind,
            plan.decodes,
            plan.num_tokens - plan.decodes,
            t.link_busy,
            device,
            t.attention_busy,
            overlap=self.overlap,
            shared_cores=self.device.type == "cpu",
        )

    def _run(self, order: Iterable[Op], s: _Step) -> None:
        """The step's order (schedule.py), op by op: every choice was made when the parts were."""
        for op in order:
            self.stages[op.kind](s, op)

    def _recover(self) -> None:
        """After a failed step: consume the results still owed, drop prefetched pages and free the
        device's cached blocks (an out-of-memory step must not leave the next one short)."""
        self.handoff.drain()
        self.experts.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- stages ---------------------------------------------------------------------------------
    def _begin_layer(self, s: _Step, op: Op) -> None:
        s.experts = s.source.begin_layer(op.layer)

    def _prefetch(self, s: _Step, op: Op) -> None:
        s.source.prefetch(op.layer, op.micro_batch, len(s.states))

    def _end_layer(self, s: _Step, op: Op) -> None:
        s.source.end_layer(op.layer)

    def _send(self, s: _Step, op: Op) -> None:
        st = s.states[op.micro_batch]
        t0 = self.clock.mark()
        qkv = pre_attention(self.spec, self.weights.layers[op.layer], st.hidden, st.positions)
        self.clock.span("pre_attention", "pre_attention", op.layer, op.micro_batch, t0, self.clock.mark())
        self.handoff.send(s.plan.step_id, op.layer, op.micro_batch, qkv, st.works, s.timings)

    def _receive(self, s: _Step, op: Op) -> None:
        """RECEIVE: the whole post-attention; COLLECT: its per-token part, the FFN left to the group."""
        st = s.states[op.micro_batch]
        attn = self.handoff.receive(s.plan.step_id, op.layer, op.micro_batch, st.hidden, s.timings)
        t0 = self.clock.mark()
        self._post_attention(s, op, st, attn)
        self.clock.span("post_attention", "post_attention", op.layer, op.micro_batch, t0, self.clock.mark())
        self.handoff.done_with_input()

    def _attend_here(self, s: _Step, op: Op) -> None:
        st = s.states[op.micro_batch]
        t0 = self.clock.mark()
        q, k, v = pre_attention(self.spec, self.weights.layers[op.layer], st.hidden, st.positions)
        t1 = self.clock.mark()
        attn = self.local.attend(op.layer, q, k, v, st)
        t2 = self.clock.mark()
        self._post_attention(s, op, st, attn)
        t3 = self.clock.mark()
        self.clock.span("pre_attention", "pre_attention", op.layer, op.micro_batch, t0, t1)
        self.clock.span("device_attention", "attention", op.layer, op.micro_batch, t1, t2)
        self.clock.span("post_attention", "post_attention", op.layer, op.micro_batch, t2, t3)

    def _post_attention(self, s: _Step, op: Op, st: MicroBatchState, attn: torch.Tensor) -> None:
        """The stage after attention, wherever attention ran: all of it, or (COLLECT, ATTEND_COLLECT)
        up to the FFN, whose input waits in the state for the group. Routing is counted for hot-expert
        residency (a dense layer routes nothing)."""
        layer = self.weights.layers[op.layer]
        if op.kind in (COLLECT, ATTEND_COLLECT):
            st.hidden, st.ffn_input = attention_output(self.spec, layer, st.hidden, attn, self.ranks.reduce)
            return
        host_counts = s.source.host_counts(len(st.hidden))
        st.hidden, counts = post_attention(self.spec, layer, st.hidden, attn, s.experts, self.ranks.reduce, host_counts)
        self.routing.add(op.layer, counts)
        FFN_PASSES.inc()

    def _group_ffn(self, s: _Step, op: Op) -> None:
        """A group's FFN over the rows of its micro-batches at once: each expert it routes to is read
        once for the group (schedule.py)."""
        group = s.states[op.micro_batch : op.micro_batch + op.count]
        t0 = self.clock.mark()
        h = torch.cat([st.hidden for st in group]) if op.count > 1 else group[0].hidden
        x = torch.cat([st.ffn_input for st in group]) if op.count > 1 else group[0].ffn_input
        assert x is not None  # set by the group's COLLECTs
        host_counts = s.source.host_counts(len(h))
        out, counts = ffn(self.spec, self.weights.layers[op.layer], h, x, s.experts, self.ranks.reduce, host_counts)
        for st, rows in zip(group, out.split([len(st.hidden) for st in group]), strict=True):
            st.hidden, st.ffn_input = rows, None
        self.routing.add(op.layer, counts)
        FFN_PASSES.inc()
        # its own stage on the timeline, at the group's first micro-batch, so the groups can be seen
        self.clock.span("post_attention", "group_experts", op.layer, op.micro_batch, t0, self.clock.mark())

    def rebalance(self) -> None:
        self.hot.rebalance()
