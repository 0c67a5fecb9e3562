"""The HRM's side of the GPU check, computed before anything runs: the batch and micro-batch its
optimizer picks for the check's model, budget and dtype on a hardware profile (the h200 preset by
default), and what the cost model then predicts per layer of a decode step: bytes streamed over the
link, link, GPU and CPU seconds, ours (CGOPipe) and (b) overlap off (the resources' times add up).
The transformers + accelerate offload baseline gets a first-principles bound of its own (the cost
model has no schedule for it). `python bench/gpu_check.py --predict-only` prints it without a GPU;
docs/cgopipe-and-benchmarks.md ("The GPU check: what it should show") holds its table."""

from __future__ import annotations

from dataclasses import asdict
from statistics import mean
from typing import Any

from bench.gpucheck.budget import HANDOFF_TOKENS, MAX_PREFILL_TOKENS, Budget
from moe_lightning.hrm.costmodel import Estimate, estimate
from moe_lightning.hrm.hardware import PRESETS, HardwareProfile, load_profile
from moe_lightning.hrm.layercost import DTYPE_BYTES, Workload, weight_bytes
from moe_lightning.hrm.optimizer import optimize
from moe_lightning.hrm.prefill_budget import prefill_budget
from moe_lightning.spec import ModelSpec

MS = 1e3
# The step schedule the main comparison runs and the cost model predicts: a step prefills or decodes,
# so its decode steps are the decode steps the prediction is of (a mixed step's prompt tokens ride in a
# decode pass the decode prediction does not see), and admission takes a batch's prompt tokens over
# max-prefill-tokens steps (~10 for 1,024 MT-Bench prompts) where a mixed budget of a few hundred
# took hundreds (issue 53).
STEP_SCHEDULE = "alternating"
# GPU name (as torch reports it) -> the preset the prediction is made on; the first that matches
GPU_PRESETS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-40g"), ("L4", "l4"), ("T4", "t4"))


def profile_for(name_or_path: str, gpu_name: str | None) -> tuple[HardwareProfile, str]:
    """The HRM's profile for the check: `auto` picks the preset of the GPU the check runs on (a plain
    lease is an H100, one asked for an H200: the same prediction for both would be wrong for one), h200
    where the name matches none; else the preset or file given. Returns it and why it was chosen."""
    if name_or_path != "auto":
        return load_profile(name_or_path), "given"
    for marker, preset in GPU_PRESETS:
        if gpu_name and marker in gpu_name and preset in PRESETS:
            return PRESETS[preset], f"from the GPU's name, {gpu_name!r}"
    why = f"no preset matches {gpu_name!r}" if gpu_name else "no GPU (a dry run or --predict-only)"
    return PRESETS["h200"], f"{why}: h200"


def _workload(n: int, gen_len: int) -> tuple[Workload, list[int]]:
    from moe_lightning.benchmark import mtbench_lengths  # the prompts bench sends for --num-prompts n

    lengths = mtbench_lengths(n)
    return Workload(mean(lengths), gen_len), lengths


def _layer(e: Estimate) -> dict[str, float]:
    r = e.resource_seconds
    return {
        "link_bytes": sum(e.link_bytes.values()),
        "expert_bytes": e.link_bytes.get("link_weights", 0.0),
        "link_s": r["link"],
        "gpu_s": r["gpu"],
        "gpu_compute_s": e.gpu_compute_seconds,  # the device's own work; gpu_s is at least the host's issue
        "host_issue_s": e.issue_seconds,
        "cpu_s": r["cpu"],
        "layer_s": e.layer_seconds,
    }


def offload_bound(
    spec: ModelSpec, budget: Budget, dtype: str, n: int, longest: int, gen_len: int, hw: HardwareProfile
) -> dict[str, Any]:
    """A first-principles bound for transformers + accelerate offloading in the same total budget.

    accelerate places whole modules in order (embeddings, decoder layers, norm, head) within its weight
    budget less the largest layer (the room that layer's weights take while it runs), the rest stay in
    host memory and cross the link at every forward pass, prefill and each decode step alike. What the
    weights leave of the total budget holds its KV cache and activations, padded to the chunk's longest
    prompt, so its batch is the largest of N, N/2, N/4, ... (its out-of-memory halving) that fits. The
    link rate is the profile's pinned one; accelerate copies from pageable memory, so this is an upper
    bound on its speed."""
    b = DTYPE_BYTES[dtype]
    w = weight_bytes(spec, b)
    layer = w["layer_dense"] + w["layer_experts"]
    embed = spec.vocab_size * spec.hidden_size * b
    modules = [embed, *([layer] * spec.num_layers), spec.hidden_size * b, w["embed_head"] - embed]
    room, placed = budget.device_memory - budget.ring_bytes - budget.reserve_bytes - layer, 0.0
    for m in modules:  # in order, stopping at the first that does not fit (accelerate moves on)
        if placed + m > room:
            break
        placed += m
    streamed = sum(modules) - placed
    per_token_kv = 2 * spec.num_layers * spec.kv_size * b
    # prefill's peak per token: the routed experts' gate/up and down activations, hidden states
    per_token_act = (spec.top_k * 3 * spec.intermediate_size + 4 * spec.hidden_size) * b
    per_seq = (longest + gen_len) * per_token_kv + longest * per_token_act
    free = budget.device_memory - placed - layer
    batch = n
    while batch > 1 and batch * per_seq > free:
        batch //= 2
    step = streamed / hw.h2d_bandwidth
    return {
        "placed_bytes": placed,
        "streamed_bytes_per_step": streamed,
        "link_seconds_per_step": step,
        "free_bytes_for_kv_and_activations": free,
        "bytes_per_sequence": per_seq,
        "batch": batch,
        "decode_tokens_per_second": batch / step,
    }


def hrm_prediction(
    spec: ModelSpec, budget: Budget, dtype: str, batch_cap: int, gen_len: int, hw: HardwareProfile
) -> dict[str, Any]:
    """The optimizer's pick (attention on the host, non-resident experts streamed to the device, as
    the check runs, gpu_expert's own resident count at this budget) among batches up to `batch_cap`,
    and the cost model's per-layer figures for ours and (b) at that policy."""
    work, _ = _workload(batch_cap, gen_len)
    pick = optimize(
        spec,
        work,
        hw,
        dtype,
        batch_cap=batch_cap,
        attention=("cpu",),
        experts=("gpu",),
        resident=budget.resident_experts,
        max_micro_batch=HANDOFF_TOKENS,  # what one hand-off carries
        kv_dtype=dtype,
    )
    policy = pick.policy
    work, lengths = _workload(policy.batch, gen_len)  # the prompts that will run: bench's first N
    ours = estimate(spec, work, hw, policy, dtype, kv_dtype=dtype, overlap=True)
    config = {  # what the main comparison's runs are pinned to, and bench reports back as in force
        "step_schedule": STEP_SCHEDULE,
        "batch": policy.batch,
        "micro_batch_size": policy.micro_batch_size,
        "expert_groups": policy.expert_groups,
        "prefill_budget": prefill_budget(ours, MAX_PREFILL_TOKENS),
    }
    off = estimate(spec, work, hw, policy, dtype, kv_dtype=dtype, overlap=False)
    offload = offload_bound(spec, budget, dtype, policy.batch, max(lengths), gen_len, hw)
    layers = spec.num_layers
    return {
        "profile": hw.name,
        "profile_source": hw.source,
        "batch_cap": batch_cap,
        "policy": {k: str(v) for k, v in asdict(policy).items()},
        "batch": policy.batch,
        "micro_batch": policy.micro_batch_size,
        "micro_batches": policy.num_micro_batches,
        "config": config,
        "workload": {"average_prompt_tokens": work.prompt_len, "gen_len": gen_len},
        "binding": ours.binding,
        "ours": {**_layer(ours), "decode_tokens_per_second": ours.tokens_per_second},
        "overlap_off": {**_layer(off), "decode_tokens_per_second": off.tokens_per_second},
        "stage_seconds": ours.stage_seconds,
        "expert_bytes_per_step": layers * ours.link_bytes.get("link_weights", 0.0),
        "link_bytes_per_step": layers * sum(ours.link_bytes.values()),
        "offload": offload,
        "ratios": {
            "ours_over_overlap_off": ours.tokens_per_second / off.tokens_per_second,
            "ours_over_offload": ours.tokens_per_second / offload["decode_tokens_per_second"],
        },
    }


def prediction_table(p: dict[str, Any]) -> list[str]:
    """The prediction as the docs' table shows it (per layer of a decode step, then per step)."""
    o, b, off = p["ours"], p["overlap_off"], p["offload"]
    gb = 1e9
    c = p["config"]
    return [
        f"HRM pick on {p['profile']}: N={p['batch']} in {p['micro_batches']} micro-batches of {p['micro_batch']}"
        f" (cap {p['batch_cap']}), {p['policy']['resident_experts']} experts resident; binds: {p['binding']}",
        f"runs as: {c['step_schedule']} steps, micro-batches of {c['micro_batch_size']}, expert groups"
        f" {c['expert_groups'] or 'none'}, prefill budget {c['prefill_budget']}",
        f"per layer: {o['expert_bytes'] / gb:.2f} GB of experts over the link = {o['link_s'] * MS:.1f} ms;"
        f" GPU {o['gpu_s'] * MS:.2f} ms (compute {o['gpu_compute_s'] * MS:.2f}, host issue"
        f" {o['host_issue_s'] * MS:.2f} for {p['micro_batches']} micro-batches); CPU {o['cpu_s'] * MS:.2f} ms",
        f"per step: {p['link_bytes_per_step'] / gb:.2f} GB over the link",
        f"ours (CGOPipe): layer {o['layer_s'] * MS:.1f} ms, {o['decode_tokens_per_second']:.0f} decode tok/s",
        f"(b) overlap off: layer {b['layer_s'] * MS:.1f} ms, {b['decode_tokens_per_second']:.0f} decode tok/s;"
        f" ours / (b) = {p['ratios']['ours_over_overlap_off']:.2f}",
        f"offload (bound): {off['streamed_bytes_per_step'] / gb:.2f} GB per step over the link"
        f" = {off['link_seconds_per_step'] * MS:.0f} ms, batch {off['batch']}"
        f" ({off['bytes_per_sequence'] / 1e6:.0f} MB per sequence in"
        f" {off['free_bytes_for_kv_and_activations'] / gb:.2f} GB), <= {off['decode_tokens_per_second']:.0f}"
        f" decode tok/s; ours / offload >= "
        f"{p['ratios']['ours_over_offload']:.1f}",
    ]


def pinned_flags(hrm: dict[str, Any]) -> tuple[str, ...]:
    """bench's flags for the configuration the HRM's prediction is of (its schedule, micro-batch, expert
    groups and prefill budget: bench reports back what was in force, the report compares the two) and
    for ours' total GPU memory within the budget, as offload's."""
    c = hrm["config"]
    flags = ("--step-schedule", c["step_schedule"], "--micro-batch-size", str(c["micro_batch_size"]))
    flags += ("--expert-groups", str(c["expert_groups"]), "--prefill-budget", str(c["prefill_budget"]))
    return (*flags, "--cap-device-memory")
