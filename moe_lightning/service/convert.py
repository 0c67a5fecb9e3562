"""Protobuf <-> domain objects for the messages several services share (the service edge only)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, TypeVar

import grpc

from moe_lightning.api.common.v1 import common_pb2
from moe_lightning.api.generation.v1 import generation_pb2
from moe_lightning.api.gpu_expert.v1 import gpu_expert_pb2
from moe_lightning.arena_layout import ArenaLayout, Page
from moe_lightning.hrm.roofs import Measurements
from moe_lightning.placement import Placement, Side
from moe_lightning.sampling import PromptLogprobs, SamplingParams, TokenLogprobs
from moe_lightning.service.errors import ServiceError
from moe_lightning.spec import ModelSpec
from moe_lightning.step_protocol import (
    RankStep,
    SequenceFault,
    SequenceWork,
    StepKind,
    StepOutput,
    StepPlan,
    StepTimings,
)
from moe_lightning.timeline import Event

_E = TypeVar("_E")

DTYPE_TO_PB = {
    "float32": common_pb2.DTYPE_FLOAT32,
    "float16": common_pb2.DTYPE_FLOAT16,
    "bfloat16": common_pb2.DTYPE_BFLOAT16,
    "int32": common_pb2.DTYPE_INT32,
    "int8": common_pb2.DTYPE_INT8,
    "uint8": common_pb2.DTYPE_UINT8,
}
DTYPE_FROM_PB = {v: k for k, v in DTYPE_TO_PB.items()}
SIDE_TO_PB = {Side.HOST: gpu_expert_pb2.SIDE_HOST, Side.DEVICE: gpu_expert_pb2.SIDE_DEVICE}
SIDE_FROM_PB = {v: k for k, v in SIDE_TO_PB.items()}
STEP_KIND_TO_PB = {
    StepKind.PREFILL: gpu_expert_pb2.STEP_KIND_PREFILL,
    StepKind.DECODE: gpu_expert_pb2.STEP_KIND_DECODE,
    StepKind.MIXED: gpu_expert_pb2.STEP_KIND_MIXED,
}
STEP_KIND_FROM_PB = {v: k for k, v in STEP_KIND_TO_PB.items()}


def model_info_to_pb(spec: ModelSpec, model_path: str = "") -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        dtype=spec.dtype,
        num_parameters=spec.num_parameters(),
        spec_json=json.dumps(spec.to_dict()),
        model_path=model_path,
    )


def spec_from_pb(info: common_pb2.ModelInfo) -> ModelSpec:
    return ModelSpec.from_dict(json.loads(info.spec_json))


def pages_to_pb(layout: ArenaLayout, region: str) -> list[common_pb2.TensorDescriptor]:
    return [
        common_pb2.TensorDescriptor(
            name=p.name, region=region, offset=p.offset, nbytes=p.nbytes, dtype=DTYPE_TO_PB[p.dtype], shape=p.shape
        )
        for p in layout.pages.values()
    ]


def layout_from_pb(pages: list[common_pb2.TensorDescriptor], total_bytes: int) -> ArenaLayout:
    out = {d.name: Page(d.name, d.offset, d.nbytes, DTYPE_FROM_PB[d.dtype], tuple(d.shape)) for d in pages}
    return ArenaLayout(out, total_bytes)


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        seed=p.seed,
        logprobs=p.logprobs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=None if p.repetition_penalty == 1.0 else p.repetition_penalty,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids,
        prompt_logprobs=p.prompt_logprobs,
    )


def sampling_controls_from_pb(m: common_pb2.SamplingParams | generation_pb2.GenerationInput) -> dict[str, Any]:
    """SamplingParams' controls from either message that carries them (the fields share their names)."""
    return {
        "presence_penalty": m.presence_penalty,
        "frequency_penalty": m.frequency_penalty,
        "repetition_penalty": m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        "logit_bias": tuple(sorted(m.logit_bias.items())),
        "min_tokens": m.min_tokens,
        "stop_token_ids": tuple(m.stop_token_ids),
        "prompt_logprobs": m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
    }


def sampling_from_pb(m: common_pb2.SamplingParams) -> SamplingParams:
    seed = m.seed if m.HasField("seed") else None
    return SamplingParams(m.temperature, m.top_k, m.top_p, seed, m.logprobs, **sampling_controls_from_pb(m))


def logprobs_to_pb(t: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=t.token_id, logprob=t.logprob, top_token_ids=t.top_token_ids, top_logprobs=t.top_logprobs
    )


def logprobs_from_pb(m: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, list(m.top_token_ids), list(m.top_logprobs))


def prompt_logprobs_to_pb(p: PromptLogprobs) -> common_pb2.PromptLogprobs:
    """Columns: a long prompt's thousands of entries cost a few packed fields, not a message each."""
    top = len(p.entries[0].top_token_ids) if p.entries else 0
    return common_pb2.PromptLogprobs(
        first_position=p.first_position,
        top=top,
        token_ids=[e.token_id for e in p.entries],
        logprobs=[e.logprob for e in p.entries],
        top_token_ids=[t for e in p.entries for t in e.top_token_ids],
        top_logprobs=[v for e in p.entries for v in e.top_logprobs],
    )


def prompt_logprobs_from_pb(m: common_pb2.PromptLogprobs) -> PromptLogprobs:
    n, k = len(m.token_ids), m.top
    if len(m.logprobs) != n or len(m.top_token_ids) != n * k or len(m.top_logprobs) != n * k:
        raise ServiceError(
            f"prompt_logprobs columns disagree: {n} tokens, {len(m.logprobs)} logprobs, top {k} with "
            f"{len(m.top_token_ids)} ids and {len(m.top_logprobs)} values",
            grpc.StatusCode.INVALID_ARGUMENT,
        )
    ids, values = list(m.top_token_ids), list(m.top_logprobs)
    entries = [
        TokenLogprobs(m.token_ids[i], m.logprobs[i], ids[i * k : (i + 1) * k], values[i * k : (i + 1) * k])
        for i in range(n)
    ]
    return PromptLogprobs(m.first_position, entries)


def step_plan_to_pb(plan: StepPlan) -> gpu_expert_pb2.StepRequest:
    return gpu_expert_pb2.StepRequest(
        step_id=plan.step_id,
        micro_batches=[
            gpu_expert_pb2.MicroBatch(
                sequences=[
                    gpu_expert_pb2.SequenceInput(
                        seq_id=s.seq_id,
                        token_ids=s.token_ids,
                        start_position=s.start,
                        sampling=None if s.sampling is None else sampling_to_pb(s.sampling),
                        draws=s.draws,
                        prompt_length=s.prompt_len,
                        token_mask=s.token_mask or b"",
                        mask_follows=s.mask_follows,
                    )
                    for s in mb
                ]
            )
            for mb in plan.micro_batches
        ],
        release_seq_ids=plan.release,
        placement=gpu_expert_pb2.Placement(
            attention=SIDE_TO_PB[plan.placement.attention], experts=SIDE_TO_PB[plan.placement.experts]
        ),
        kind=STEP_KIND_TO_PB[plan.kind],
        expert_groups=plan.expert_groups,
        decodes=plan.decodes,
    )


def step_plan_from_pb(m: gpu_expert_pb2.StepRequest) -> StepPlan:
    return StepPlan(
        step_id=m.step_id,
        micro_batches=[
            [
                SequenceWork(
                    s.seq_id,
                    list(s.token_ids),
                    s.start_position,
                    sampling_from_pb(s.sampling) if s.HasField("sampling") else None,
                    s.draws,
                    s.prompt_length,
                    s.token_mask or None,
                    s.mask_follows,
                )
                for s in mb.sequences
            ]
            for mb in m.micro_batches
        ],
        kind=_enum_from_pb(STEP_KIND_FROM_PB, m.kind, "kind"),
        release=list(m.release_seq_ids),
        placement=Placement(
            _enum_from_pb(SIDE_FROM_PB, m.placement.attention, "placement.attention"),
            _enum_from_pb(SIDE_FROM_PB, m.placement.experts, "placement.experts"),
        ),
        expert_groups=m.expert_groups,
        decodes=m.decodes,
    )


def step_output_to_pb(out: StepOutput) -> gpu_expert_pb2.StepResponse:
    return gpu_expert_pb2.StepResponse(
        seq_ids=out.seq_ids,
        token_ids=out.token_ids,
        timings=gpu_expert_pb2.StepTimings(
            kind=STEP_KIND_TO_PB[out.timings.kind], **{f"{k}_ns": v for k, v in out.timings.stages().items()}
        ),
        logprob_seq_ids=list(out.logprobs),
        logprobs=[logprobs_to_pb(t) for t in out.logprobs.values()],
        prompt_logprob_seq_ids=list(out.prompt_logprobs),
        prompt_logprobs=[prompt_logprobs_to_pb(p) for p in out.prompt_logprobs.values()],
        faults=[
            gpu_expert_pb2.SequenceFault(seq_id=s, message=f.message, invalid_argument=f.invalid_argument)
            for s, f in out.faults.items()
        ],
        ranks=[
            gpu_expert_pb2.RankStep(
                rank=r.rank,
                bytes_streamed=r.bytes_streamed,
                expert_wait_ns=r.expert_wait,
                collectives_ns=r.collectives,
                step_ns=r.step,
            )
            for r in out.ranks
        ],
    )


def step_output_from_pb(m: gpu_expert_pb2.StepResponse) -> StepOutput:
    logprobs = {s: logprobs_from_pb(t) for s, t in zip(m.logprob_seq_ids, m.logprobs, strict=True)}
    t = m.timings
    timings = StepTimings(
        _enum_from_pb(STEP_KIND_FROM_PB, t.kind, "timings.kind"),
        **{k: getattr(t, f"{k}_ns") for k in StepTimings().stages()},
    )
    ranks = [RankStep(r.rank, r.bytes_streamed, r.expert_wait_ns, r.collectives_ns, r.step_ns) for r in m.ranks]
    prompt = {s: prompt_logprobs_from_pb(p) for s, p in zip(m.prompt_logprob_seq_ids, m.prompt_logprobs, strict=True)}
    faults = {f.seq_id: SequenceFault(f.message, f.invalid_argument) for f in m.faults}
    return StepOutput(list(m.seq_ids), list(m.token_ids), timings, logprobs, ranks, prompt, faults)


def _enum_from_pb(table: dict[int, _E], value: int, field: str) -> _E:
    """An enum field an older peer left unset is a contract error, not a default."""
    try:
        return table[value]
    except KeyError:
        raise ServiceError(
            f"{field} must be set (one of {', '.join(str(v) for v in table.values())}), got {value}",
            grpc.StatusCode.INVALID_ARGUMENT,
        ) from None


def measurements_to_pb(m: Measurements) -> common_pb2.HardwareMeasurements:
    return common_pb2.HardwareMeasurements(**asdict(m))


def measurements_from_pb(m: common_pb2.HardwareMeasurements) -> Measurements:
    return Measurements(
        m.matmul_flops,
        m.weight_stream_bandwidth,
        m.attention_bandwidth,
        m.memory_bytes,
        m.h2d_bandwidth,
        m.d2h_bandwidth,
        m.shared_host_device,
        m.source,
        m.expert_format or "none",  # a peer from before quantized pages leaves it unset
        m.expert_matmul_flops,
        m.expert_stream_bandwidth,
        m.simulated_link,
        m.host_micro_batch_seconds,  # 0 from a peer that does not measure the host's issue time
        m.host_ffn_seconds,
        m.host_expert_seconds,
    )


def timeline_to_pb(events: list[Event]) -> common_pb2.TimelineSpans:
    names: dict[str, int] = {}

    def ix(name: str) -> int:
        return names.setdefault(name, len(names))

    pb = common_pb2.TimelineSpans(
        resource=[ix(e.resource) for e in events],
        stage=[ix(e.stage) for e in events],
        step=[e.step for e in events],
        layer=[e.layer for e in events],
        micro_batch=[e.micro_batch for e in events],
        start_ns=[e.start_ns for e in events],
        end_ns=[e.end_ns for e in events],
        service=[ix(e.service) for e in events],
    )
    pb.names.extend(names)  # in index order: dicts keep insertion order
    return pb


def timeline_from_pb(pb: common_pb2.TimelineSpans) -> list[Event]:
    n = pb.names
    columns = (pb.resource, pb.stage, pb.step, pb.layer, pb.micro_batch, pb.start_ns, pb.end_ns, pb.service)
    return [
        Event(n[r], n[st], step, layer, mb, t0, t1, n[svc])
        for r, st, step, layer, mb, t0, t1, svc in zip(*columns, strict=True)
    ]
