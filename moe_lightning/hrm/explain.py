"""A plan in words (what bounds it, how far from each roof) and as JSON."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

from moe_lightning.hrm.costmodel import Estimate
from moe_lightning.hrm.hardware import HardwareProfile
from moe_lightning.hrm.layercost import (
    EXPECTED_USE,
    MAX_CONTEXT,
    NO_QUANT,
    Headroom,
    Workload,
    kv_token_bytes,
    kv_tokens,
)
from moe_lightning.hrm.optimizer import max_batch
from moe_lightning.hrm.schedule_cost import schedule_throughput
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec

ROOF_NAMES = {"gpu": "device compute/HBM roof", "cpu": "host compute/DRAM roof", "link": "host-device link roof"}


@dataclass(frozen=True, slots=True)
class HostKV:
    """The batch the host holds: sequences whose KV, counted by the rule, fits in host memory beside the
    weights."""

    dtype: str  # the KV format
    tokens_per_sequence: float  # what the rule counts per sequence: s + n ("max"), s + n/2 ("expected")
    bytes_per_sequence: float  # K and V of all layers for those tokens
    sequences: int
    rule: str  # layercost.KV_RULES
    headroom_tokens: float = 0.0  # "expected": kept free for the batch's spread, for `sequences`


def host_kv(
    spec: ModelSpec,
    work: Workload,
    hw: HardwareProfile,
    dtype: str | None,
    kv_dtype: str,
    headroom: Headroom = Headroom(),
    quant: QuantScheme = NO_QUANT,
    kv_rule: str = EXPECTED_USE,
) -> HostKV:
    tokens = work.max_context if kv_rule == MAX_CONTEXT else work.avg_context
    share = 1.0 if kv_rule == MAX_CONTEXT else spec.attended_share(tokens)  # sliding layers: their window
    per_seq = kv_token_bytes(spec, kv_dtype) * spec.num_layers * tokens * share
    sequences = max_batch(spec, work, hw, dtype, headroom, sys.maxsize, kv_dtype, quant, kv_rule)
    spare = kv_tokens(sequences, work, kv_rule, headroom) - sequences * tokens
    return HostKV(kv_dtype, tokens, per_seq, sequences, kv_rule, spare)


def page_format(est: Estimate) -> str:
    """The expert pages' format in words: "bfloat16" (the model's), "int8", "int4, groups of 128"."""
    q = est.quant
    if not q.quantized:
        return "the model dtype"
    if q.format == "int4":
        groups = "one group per row" if q.group_size == -1 else f"groups of {q.group_size}"
        return f"int4, {groups}" + (", activation order" if q.act_order else "")
    return q.format.value


def link_bytes_per_step(spec: ModelSpec, est: Estimate) -> dict[str, float]:
    """What the link carries in one decode step: the streamed expert pages and everything."""
    per_layer = est.link_bytes
    return {
        "expert_pages": per_layer.get("link_weights", 0.0) * spec.num_layers,
        "total": sum(per_layer.values()) * spec.num_layers,
    }


def plan_to_dict(
    name: str, spec: ModelSpec, work: Workload, hw: HardwareProfile, est: Estimate, kv: HostKV | None = None
) -> dict[str, Any]:
    p = est.policy
    st = schedule_throughput(spec, work, est)
    out = {
        "model": name,
        "parameters": spec.num_parameters(),
        "hardware": hw.name,
        "prompt_len": work.prompt_len,
        "prompt_std": work.prompt_std,
        "gen_len": work.gen_len,
        "kv_rule": est.kv_rule,
        "kv_format": est.kv_format,
        "policy": {
            "batch_size": p.batch,
            "micro_batch_size": p.micro_batch_size,
            "num_micro_batches": p.num_micro_batches,
            "attention": p.attention,
            "experts": p.experts,
            "resident_experts": p.resident_experts,
            "resident_fraction": p.resident_experts / spec.total_experts,
            "kv_gpu_fraction": p.kv_gpu_fraction,
            "expert_groups": p.expert_groups,  # 0: once per micro-batch (Policy.expert_groups)
        },
        "expert_pages": {
            "format": est.quant.format.value,
            "group_size": est.quant.group_size if est.quant.format == "int4" else None,
            "act_order": est.quant.act_order,
            "bytes_per_page": est.page_bytes,
            "kernels": est.kernels,
        },
        "link_bytes_per_step": link_bytes_per_step(spec, est),
        "predicted_decode_tokens_per_second": est.tokens_per_second,
        "layer_seconds": est.layer_seconds,
        "stage_seconds_per_layer": est.stage_seconds,
        "resource_seconds_per_layer": est.resource_seconds,
        # the host's time to issue a layer's kernels, and the device's compute it bounds (a GPU) or
        # adds to (a CPU device): resource_seconds_per_layer's gpu is made of the two
        "host_issue_seconds_per_layer": est.issue_seconds,
        "gpu_compute_seconds_per_layer": est.gpu_compute_seconds,
        "binding_resource": est.binding,
        "memory_bytes": {
            "gpu": est.gpu_bytes,
            "gpu_capacity": est.gpu_capacity,
            "cpu": est.cpu_bytes,
            "cpu_capacity": est.cpu_capacity,
            "cpu_kv_cache": est.kv_host_bytes,
        },
        # a long job with continuous admission, prefill included (hrm/schedule_cost.py)
        "with_prefill_tokens_per_second": {"mixed": st.mixed, "alternating": st.alternating},
        "prompt_tokens_per_step": st.prompt_tokens_per_step,
    }
    if kv is not None:
        out["kv_cache"] = asdict(kv)
    return out


def expert_schedule(est: Estimate) -> str:
    """How often a layer runs its experts: "once per micro-batch" or "once per group, 2 groups of 6-7
    micro-batches", with how many times the device reads each expert it touches."""
    p = est.policy
    n_ub, g = p.num_micro_batches, p.effective_expert_groups
    reads = f"each touched expert read {g} time{'s' if g > 1 else ''} a layer"
    if g >= n_ub:
        return f"once per micro-batch ({reads})"
    size, extra = divmod(n_ub, g)  # services/gpu_expert/schedule.py group_bounds: the first `extra` one longer
    sizes = f"{size}-{size + 1}" if extra else f"{size}"
    return f"once per group, {g} group{'s' if g > 1 else ''} of {sizes} micro-batches ({reads}, not {n_ub})"


def link_text(spec: ModelSpec, est: Estimate) -> str:
    if not est.link_bytes:
        return "none: host and device are one memory"
    step = link_bytes_per_step(spec, est)
    return (
        f"{step['total'] / 1e9:,.2f} GB per decode step, of which expert pages "
        f"{step['expert_pages'] / 1e9:,.2f} GB ({step['expert_pages'] / max(est.page_bytes, 1):,.0f} pages)"
    )


def explain(
    name: str, spec: ModelSpec, work: Workload, hw: HardwareProfile, est: Estimate, kv: HostKV | None = None
) -> str:
    p = est.policy
    ms = {k: 1e3 * v for k, v in est.resource_seconds.items()}
    lines = [
        f"{name} ({spec.num_parameters() / 1e9:.1f} B parameters, {spec.dtype}) on {hw.name}: "
        f"prompt {work.prompt_len:g} tokens, {work.gen_len} generated",
        f"policy     batch {p.batch} = {p.num_micro_batches} micro-batches x {p.micro_batch_size}; attention on "
        f"{p.attention}, experts on {p.experts}; {p.resident_experts} of {spec.total_experts} "
        f"expert pages resident on the device"
        + (f"; {p.kv_gpu_fraction:.0%} of the KV cache on the device" if p.attention == "gpu" else ""),
        f"schedule   experts {expert_schedule(est)}",
        f"experts    pages in {page_format(est)}: {est.page_bytes / 1e6:,.1f} MB each"
        + (f"; expert GEMM by {', '.join(sorted(set(est.kernels.values())))}" if est.quant.quantized else ""),
        f"link       {link_text(spec, est)}",
        f"predicted  {est.tokens_per_second:,.1f} decode tokens/s ({1e3 * est.layer_seconds:.2f} ms per layer, "
        f"{1e3 * est.layer_seconds * spec.num_layers:.0f} ms per step)",
        prefill_text(spec, work, est),
        "per layer  " + " | ".join(resource_text(est, r) for r in ("gpu", "cpu", "link") if ms[r] > 0),
        f"bound by   {est.binding}: the {binding_name(est, hw)}"
        + "".join(f"; {r} busy {ms[r] / ms[est.binding]:.0%} of it" for r in ms if r != est.binding and ms[r] > 0)
        + ("; host and device are the same cores here, so their times add" if hw.shared_host_device else ""),
        f"memory     device {est.gpu_bytes / 1e9:.1f} of {est.gpu_capacity / 1e9:.1f} GB usable, host "
        f"{est.cpu_bytes / 1e9:.1f} of {est.cpu_capacity / 1e9:.1f} GB usable",
    ]
    if kv is not None:
        lines.append(kv_text(work, est, kv))
    return "\n".join(lines)


def resource_text(est: Estimate, resource: str) -> str:
    """A resource's time per layer by stage: "gpu 1.20 ms (dense 0.20, experts 1.00)". The device's
    host issue time (layercost.py) is not one of its stages: it bounds them (a GPU) or adds to them (a
    CPU device), so it is shown beside their sum."""
    stages = {s.split("_", 1)[1]: v for s, v in est.stage_seconds.items() if s.startswith(resource + "_")}
    issue = stages.pop("issue", 0.0)
    text = ", ".join(f"{s} {1e3 * v:.2f}" for s, v in stages.items())
    if issue > 0:
        text += f" = {1e3 * est.gpu_compute_seconds:.2f}; host issue {1e3 * issue:.2f}"
    return f"{resource} {1e3 * est.resource_seconds[resource]:.2f} ms ({text})"


def binding_name(est: Estimate, hw: HardwareProfile) -> str:
    """The binding roof in words; the device's when the host's issue time is what holds it."""
    if est.binding == "gpu" and est.issue_seconds > est.gpu_compute_seconds and not hw.shared_host_device:
        n_ub = est.policy.num_micro_batches
        return (
            f"host's kernel issue ({1e3 * est.issue_seconds:.2f} ms a layer for {n_ub} micro-batch"
            f"{'es' if n_ub > 1 else ''}, above the device's {1e3 * est.gpu_compute_seconds:.2f} ms of compute)"
        )
    return ROOF_NAMES[est.binding]


def prefill_text(spec: ModelSpec, work: Workload, est: Estimate) -> str:
    """The job's line, prefill included (hrm/schedule_cost.py): the two step schedules."""
    st = schedule_throughput(spec, work, est)
    return (
        f"with prefill  {st.mixed:,.1f} generated tokens/s in mixed steps, {st.alternating:,.1f} alternating "
        f"({st.mixed_vs_alternating:.2f}x): a long job, continuous admission, {st.prompt_tokens_per_step:,.0f} "
        "prompt tokens a step"
    )


def kv_text(work: Workload, est: Estimate, kv: HostKV) -> str:
    """The host KV cache's line: how many sequences it holds by which rule."""
    if kv.rule == MAX_CONTEXT:
        return (
            f"kv cache   the host holds {kv.sequences:,} sequences of {kv.tokens_per_sequence:g} tokens in {kv.dtype} "
            f"({kv.bytes_per_sequence / 1e6:.1f} MB each; KV {est.kv_host_bytes / 1e9:.1f} GB for this batch)"
        )
    return (
        f"kv cache   the host holds {kv.sequences:,} sequences of {kv.tokens_per_sequence:g} tokens on average "
        f"(prompt {work.prompt_len:g} +- {work.prompt_std:g}, half of {work.gen_len} generated) in {kv.dtype}, "
        f"{kv.bytes_per_sequence / 1e6:.1f} MB each, with {kv.headroom_tokens:,.0f} tokens kept free for their "
        f"spread; KV {est.kv_host_bytes / 1e9:.1f} GB for this batch"
    )
