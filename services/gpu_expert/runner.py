"""Runs a step's stages on the device: pre-attention, hand-off to attention, post-attention, head.

The weights are views into the weight store's arena (zero-copy when the device is the CPU, one
copy onto an accelerator). Sampler state (each sequence's random stream) lives here between steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
import torch
from prometheus_client import Counter

from moe_lightning.kv_cache import KVCacheFullError, PagedKVCache
from moe_lightning.plan import SequenceWork, StepOutput, StepPlan
from moe_lightning.sampling import SamplingParams, sample, token_logprobs
from moe_lightning.service.errors import NotReadyError, ServiceError
from moe_lightning.service.metrics import HANDOFF_LATENCY, HANDOFF_WORK, HANDOFFS, SHM_WAIT
from moe_lightning.service.metrics import STAGE_BUSY as BUSY
from moe_lightning.shm import ChannelTimeoutError, TensorChannel
from moe_lightning.spec import ModelSpec
from moe_lightning.stages import embed_tokens, head_logits, post_attention, pre_attention
from moe_lightning.stages.attention import AttentionPlan, paged_attention, plan_attention, write_kv
from moe_lightning.timeline import TimelineRecorder
from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights
from services.gpu_expert.pager import ExpertPager
from services.gpu_expert.residency import plan_residency

STEPS = Counter("moe_lightning_steps_total", "Steps run", ["kind"])
ROUTED = Counter("moe_lightning_expert_routed_tokens_total", "Tokens routed to each expert", ["layer", "expert"])
RESIDENCY_CHANGES = Counter("moe_lightning_residency_changes_total", "Hot-expert residency updates")
EXPORT_EVERY = 16  # decode steps between routing-counter flushes
TOKENS = Counter("moe_lightning_sampled_tokens_total", "Tokens sampled by the head")


@dataclass(slots=True)
class _MicroBatchState:
    works: list[SequenceWork]
    positions: torch.Tensor  # (T,)
    hidden: torch.Tensor  # (T, D)
    last_rows: torch.Tensor  # (B,)
    attention: AttentionPlan | None = None  # set when attention runs here, over the device KV cache


class ExpertRunner:
    def __init__(
        self,
        spec: ModelSpec,
        weights: ModelWeights,
        device: torch.device,
        output: TensorChannel,
        pager: ExpertPager | None = None,
        kv: PagedKVCache | None = None,
        handoff_timeout: float = 60.0,
        residency_interval: int = 0,
        timeline: TimelineRecorder | None = None,
        overlap: bool = True,
        experts_on_host: bool = False,
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.device = device
        self.output = output
        self.pager = pager
        self.kv = kv  # the device KV cache (attention placed on the device); None: attention service only
        self.input: TensorChannel | None = None
        self.session = 0
        self.handoff_timeout = handoff_timeout
        self.samplers: dict[int, tuple[SamplingParams, torch.Generator | None]] = {}
        self.log = structlog.get_logger()
        self.residency_interval = residency_interval
        self.overlap = overlap
        self.experts_on_host = experts_on_host  # placement: streamed experts run on the host, not copied
        self.timeline = timeline or TimelineRecorder(None, "gpu_expert")
        self.route_counts = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.long, device=device)
        self._exported = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.long)
        self._decode_steps = 0

    def connect(self, input_channel: str, session: int = 0) -> None:
        """Wires the attention channel and starts a new session (see the attention worker's connect):
        sampler streams, the device KV cache and prefetched pages of earlier requests are dropped."""
        self.session = session  # stamped on every hand-off; replies of another session are stale
        self.samplers.clear()
        if self.kv is not None:
            self.kv.reset()
        if self.pager is not None:
            self.pager.reset()
        if self.input is not None:  # closed first: its 'closed' flag must not land after the new attach
            self.input.close()
            self.input = None
        self.input = TensorChannel.attach(input_channel)
        self.log.info("input_connected", channel=input_channel)

    def _prepare(self, plan: StepPlan) -> list[_MicroBatchState]:
        for seq in plan.release:
            self.samplers.pop(seq, None)
            if self.kv is not None:
                self.kv.free(seq)
        if plan.attention_on_device and self.kv is None:
            raise ServiceError(
                "attention on the device was asked for, but this gpu_expert has no device KV cache "
                "(start it with --device-kv-memory)",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if self.pager is not None and plan.experts_on_host != self.experts_on_host:
            self.pager.reset()  # placement changed: pages prefetched for the old one are dropped
            self.experts_on_host = plan.experts_on_host
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
            tokens = torch.tensor([t for w in mb for t in w.token_ids], dtype=torch.long, device=self.device)
            positions = torch.cat([torch.arange(w.start, w.start + len(w.token_ids)) for w in mb]).to(self.device)
            last = torch.tensor([len(w.token_ids) for w in mb]).cumsum(0) - 1
            st = _MicroBatchState(mb, positions, embed_tokens(self.weights.embed, tokens), last.to(self.device))
            if plan.attention_on_device:
                assert self.kv is not None
                try:
                    md = self.kv.begin([w.seq_id for w in mb], [len(w.token_ids) for w in mb], [w.start for w in mb])
                except ValueError as exc:
                    raise ServiceError(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from exc
                st.attention = plan_attention(md, self.spec.sliding_window)
            states.append(st)
        return states

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        if self.input is None and not plan.attention_on_device:
            raise NotReadyError("gpu_expert is not connected to an attention service yet")
        t_start = time.perf_counter_ns()
        timings = {
            "pre_attention": 0,
            "post_attention": 0,
            "head": 0,
            "attention_wait": 0,
            "handoff_send": 0,
            "expert_wait": 0,
            "device_attention": 0,
        }
        states = self._prepare(plan)
        outstanding = 0
        try:
            for layer_idx, layer in enumerate(self.weights.layers):
                if plan.attention_on_device:  # no hand-offs: the pages of the next layer still interleave
                    experts = self._experts(layer_idx, timings)
                    self._prefetch(layer_idx + 1, 0, len(states))
                    for m, st in enumerate(states):
                        self._attend_here(plan, layer_idx, layer, m, st, experts, timings)
                        self._prefetch(layer_idx + 1, m + 1, len(states))
                elif self.overlap:
                    # every micro-batch's q/k/v goes out before the first result is awaited: attention
                    # on micro-batch k+1 runs while this process does post-attention for k, and page
                    # k+1 of the next layer's streamed experts copies meanwhile
                    for m, st in enumerate(states):
                        self._send(plan, layer_idx, layer, m, st, timings)
                        outstanding += 1
                    experts = self._experts(layer_idx, timings)
                    self._prefetch(layer_idx + 1, 0, len(states))
                    for m, st in enumerate(states):
                        self._receive(plan, layer_idx, layer, m, st, experts, timings)
                        outstanding -= 1
                        self._prefetch(layer_idx + 1, m + 1, len(states))
                else:  # the FlexGen/DeepSpeed-style schedule: each stage waits for the previous one
                    experts = self._experts(layer_idx, timings)
                    for m, st in enumerate(states):
                        self._send(plan, layer_idx, layer, m, st, timings)
                        outstanding += 1
                        self._receive(plan, layer_idx, layer, m, st, experts, timings)
                        outstanding -= 1
                if self.pager is not None and not self.experts_on_host:
                    self.pager.end_layer(layer_idx)
        except BaseException:
            self._drain(outstanding)
            if self.pager is not None:
                self.pager.reset()
            raise
        if self.pager is not None:
            self.pager.end_step()
        t0 = time.perf_counter_ns()
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
        timings["head"] = time.perf_counter_ns() - t0
        self.timeline.record("device", "head", plan.step_id, -1, -1, t0)
        timings["step"] = time.perf_counter_ns() - t_start
        BUSY.labels("pre_attention").inc(timings["pre_attention"] / 1e9)
        BUSY.labels("post_attention").inc(timings["post_attention"] / 1e9)
        BUSY.labels("head").inc(timings["head"] / 1e9)
        SHM_WAIT.inc(timings["attention_wait"] / 1e9)
        decode = plan.num_tokens == plan.num_sequences
        STEPS.labels("decode" if decode else "prefill").inc()
        TOKENS.inc(len(tokens))
        if decode:
            self._decode_steps += 1
            if self._decode_steps % EXPORT_EVERY == 0:
                self.export_routing()
            if self.residency_interval and self._decode_steps % self.residency_interval == 0:
                self.rebalance()
        return StepOutput([w.seq_id for w in works], tokens, timings, logprobs)

    def _send(
        self, plan: StepPlan, layer_idx: int, layer: LayerWeights, m: int, st: _MicroBatchState, timings: dict[str, int]
    ) -> None:
        t0 = time.perf_counter_ns()
        q, k, v = pre_attention(self.spec, layer, st.hidden, st.positions)
        t1 = time.perf_counter_ns()
        self.timeline.record("device", "pre_attention", plan.step_id, layer_idx, m, t0, t1)
        meta: dict = {"s": plan.step_id, "l": layer_idx, "m": m, "sn": self.session}
        if layer_idx == 0:
            meta.update(
                seqs=[w.seq_id for w in st.works], q=[len(w.token_ids) for w in st.works], p=[w.start for w in st.works]
            )
        self.output.send(meta, [q, k, v], timeout=self.handoff_timeout)
        HANDOFFS.labels("out").inc()
        HANDOFF_WORK.labels("out").inc(self.output.last_work_ns / 1e9)
        timings["pre_attention"] += t1 - t0
        timings["handoff_send"] += time.perf_counter_ns() - t1

    def _experts(self, layer_idx: int, timings: dict[str, int]) -> Sequence[ExpertWeights] | None:
        if self.pager is None:
            return None
        if self.experts_on_host:  # non-resident experts compute where they live: no transfer
            resident = self.pager.resident[layer_idx]
            host = self.weights.layers[layer_idx].experts
            return [resident.get(e) or host[e] for e in range(len(host))]
        t0 = time.perf_counter_ns()
        experts = self.pager.begin_layer(layer_idx)
        timings["expert_wait"] += time.perf_counter_ns() - t0
        return experts

    def _prefetch(self, layer_idx: int, page: int, num_pages: int) -> None:
        if self.pager is not None and not self.experts_on_host:
            self.pager.prefetch_page(layer_idx, page, num_pages)

    def _receive(
        self,
        plan: StepPlan,
        layer_idx: int,
        layer: LayerWeights,
        m: int,
        st: _MicroBatchState,
        experts: Sequence[ExpertWeights] | None,
        timings: dict[str, int],
    ) -> None:
        assert self.input is not None
        t0 = time.perf_counter_ns()
        reply, tensors = self.input.recv(timeout=self.handoff_timeout)
        while reply.get("sn", self.session) != self.session:  # left over from a session before a restart
            self.input.release()
            self.log.warning("stale_handoff_dropped", step=reply.get("s"), layer=reply.get("l"))
            reply, tensors = self.input.recv(timeout=self.handoff_timeout)
        HANDOFFS.labels("in").inc()
        HANDOFF_LATENCY.labels("in").inc(self.input.last_latency_ns / 1e9)
        HANDOFF_WORK.labels("in").inc(self.input.last_work_ns / 1e9)
        t1 = time.perf_counter_ns()
        self._check_reply(reply, plan.step_id, layer_idx, m)
        self._post_attention(layer_idx, layer, st, tensors[0].to(self.device), experts)
        self.input.release()
        timings["attention_wait"] += t1 - t0
        timings["post_attention"] += time.perf_counter_ns() - t1
        self.timeline.record("device", "post_attention", plan.step_id, layer_idx, m, t1)

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
        st.hidden, ids = post_attention(self.spec, layer, st.hidden, attn, experts)
        if ids.numel():
            self.route_counts[layer_idx] += torch.bincount(ids.reshape(-1), minlength=self.spec.num_experts)

    def _attend_here(
        self,
        plan: StepPlan,
        layer_idx: int,
        layer: LayerWeights,
        m: int,
        st: _MicroBatchState,
        experts: Sequence[ExpertWeights] | None,
        timings: dict[str, int],
    ) -> None:
        assert self.kv is not None and st.attention is not None
        t0 = time.perf_counter_ns()
        q, k, v = pre_attention(self.spec, layer, st.hidden, st.positions)
        t1 = time.perf_counter_ns()
        write_kv(self.kv.k[layer_idx], self.kv.v[layer_idx], k, v, st.attention.write_slots)
        attn = paged_attention(q, self.kv.k[layer_idx], self.kv.v[layer_idx], st.attention)
        t2 = time.perf_counter_ns()
        self._post_attention(layer_idx, layer, st, attn, experts)
        t3 = time.perf_counter_ns()
        self.timeline.record("device", "pre_attention", plan.step_id, layer_idx, m, t0, t1)
        self.timeline.record("device", "attention", plan.step_id, layer_idx, m, t1, t2)
        self.timeline.record("device", "post_attention", plan.step_id, layer_idx, m, t2, t3)
        timings["pre_attention"] += t1 - t0
        timings["device_attention"] += t2 - t1
        timings["post_attention"] += t3 - t2

    def export_routing(self) -> None:
        """Routing counters per (layer, expert), flushed in batches: a label lookup per series per step
        would cost more than the step's hand-offs."""
        counts = self.route_counts.cpu()
        new = counts - self._exported
        self._exported = counts
        for layer, expert in new.nonzero().tolist():
            ROUTED.labels(str(layer), str(expert)).inc(int(new[layer, expert]))

    def rebalance(self) -> None:
        """Between steps: keep the experts that routing uses most resident (hot-expert residency)."""
        pager = self.pager
        if pager is None or pager.plan.max_streamed == 0:
            return
        hot = self.route_counts.cpu().tolist()
        p = pager.plan
        new = plan_residency(
            self.spec.num_layers,
            self.spec.num_experts,
            p.expert_bytes,
            p.dense_bytes,
            p.budget,
            hot=hot,
            stream=p.ring_slots > 0,
            dense_layers=self.spec.dense_layers,
        )
        if new.resident != p.resident and new.ring_slots == p.ring_slots:
            moved = sum(len(set(a) ^ set(b)) for a, b in zip(new.resident, p.resident, strict=True)) // 2
            pager.update_residency(new)
            RESIDENCY_CHANGES.inc()
            self.log.info("residency_updated", experts_swapped=moved, after_decode_steps=self._decode_steps)
        self.route_counts //= 2  # decay: recent routing counts most

    def _check_reply(self, reply: dict, step: int, layer: int, m: int) -> None:
        if "error" in reply:
            if reply.get("code") == "RESOURCE_EXHAUSTED":
                raise KVCacheFullError(reply["error"])
            raise ServiceError(
                f"attention failed: {reply['error']}",
                getattr(grpc.StatusCode, reply.get("code", "INTERNAL"), grpc.StatusCode.INTERNAL),
            )
        if (reply["s"], reply["l"], reply["m"]) != (step, layer, m):
            raise ServiceError(
                f"hand-off out of order: expected {(step, layer, m)}, got {(reply['s'], reply['l'], reply['m'])}"
            )

    def _drain(self, outstanding: int) -> None:
        """After a failure, consume the replies still owed so the next step starts clean."""
        if self.input is None:
            return
        for _ in range(outstanding):
            try:
                self.input.recv(timeout=5.0)
                self.input.release()
            except (ChannelTimeoutError, RuntimeError):
                return
