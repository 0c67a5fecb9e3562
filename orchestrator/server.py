"""orchestrator: the public Generation API, tokenization, the request queue and batcher, and the
driver that runs each step across gpu_expert and cpu_attention."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_lightning.api.generation.v1 import generation_pb2_grpc
from moe_lightning.chat_template import ChatTemplate
from moe_lightning.config.choices import EXPERT_GROUP_CHOICES
from moe_lightning.config.flag import EnvDefaultsParser
from moe_lightning.config.orchestrator import OrchestratorConfig
from moe_lightning.hrm.layercost import KV_RULE_FOR_ADMISSION, MTBENCH_PROMPT_LEN, MTBENCH_PROMPT_STD, Workload
from moe_lightning.hrm.prefill_budget import prefill_budget
from moe_lightning.hrm.roofs import profile_from
from moe_lightning.placement import Side
from moe_lightning.service.aio_runtime import AioServiceRuntime, serve_aio
from moe_lightning.service.concurrency import AioConcurrencyLimit
from moe_lightning.service.names import GENERATION
from moe_lightning.spec import ModelSpec
from moe_lightning.template_renderer import TemplateRenderer
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import max_text_bytes
from orchestrator import metrics
from orchestrator.api import MAX_BATCH_PROMPTS, GenerationServicer, max_receive_bytes
from orchestrator.backend import Backend, Capacity
from orchestrator.debug import DebugPages
from orchestrator.output_formats import output_formats
from orchestrator.planner import Planner, PlannerConfig
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.supervisor import BackendSupervisor


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-orchestrator", description=__doc__)
    OrchestratorConfig.add_cli_args(p)
    return p


def default_max_queue(max_batch_size: int | None) -> int:
    """A client filling the planned batch N (GenerationClient.batch_generate_all) keeps ceil(N/c) + 1
    calls of c prompts in flight, at most N + 2c - 1 requests: with c up to one BatchGenerate's limit
    this default never refuses it, for any batch the planner may choose or the operator fixed."""
    return max(PlannerConfig().batch_cap, max_batch_size or 0) + 2 * MAX_BATCH_PROMPTS


def default_max_concurrent_rpcs(max_batch_size: int | None, max_queue: int | None) -> int:
    """Every request this server may hold (the largest batch it may plan, and the queue) as a call of
    its own: calls past it could only be refused by the queue, after they were read and tokenised."""
    queue = max_queue if max_queue is not None else default_max_queue(max_batch_size)
    return max(PlannerConfig().batch_cap, max_batch_size or 0) + queue


def _check_handoff_limits(config: OrchestratorConfig, max_tokens: int) -> None:
    """A micro-batch must fit one hand-off slot; the workers size theirs (--max-tokens-per-handoff)."""
    limits = (("--max-prefill-tokens", config.max_prefill_tokens), ("--micro-batch-size", config.micro_batch_size))
    for flag, value in limits:
        if value is not None and value > max_tokens:
            raise ValueError(
                f"{flag} {value} exceeds the {max_tokens} tokens one hand-off carries; lower it, or start "
                f"gpu_expert and cpu_attention with --max-tokens-per-handoff {value}"
            )


def _placements(config: OrchestratorConfig, capacity: Capacity, spec: ModelSpec) -> tuple[tuple[Side, ...], ...]:
    """The placements the planner may choose from: what the services support, narrowed by the flags."""
    attention, experts = capacity.placements(spec)
    chosen = []
    for flag, supported, why in (
        (config.attention_placement, attention, "gpu_expert has no device KV cache (--device-kv-memory)"),
        (config.experts_placement, experts, "gpu_expert has no room to stream experts within --device-memory"),
    ):
        if flag == "auto":
            chosen.append(supported)
        elif flag in supported:
            chosen.append((Side(flag),))
        else:
            raise ValueError(f"placement {flag!r} is not available: {why}; available: {', '.join(supported)}")
    return tuple(chosen)


def _start(
    config: OrchestratorConfig,
    backend: Backend,
    servicer: GenerationServicer,
    runtime: AioServiceRuntime,
    pages: DebugPages,
) -> dict[str, Any]:
    """Waits for the workers, plans the batch and the placement, starts the scheduler; the fields of
    the `serving` line. A peer that never comes up and a plan the services cannot run alike fail it."""
    log = runtime.log
    capacity = backend.connect(stop=runtime)
    assert backend.spec is not None
    tokenizer = TextTokenizer.from_model_dir(config.tokenizer or backend.model_path)
    if tokenizer is not None:
        tokenizer.check_fits(backend.spec.vocab_size, config.tokenizer or backend.model_path)
    servicer.chat_template = ChatTemplate.from_model_dir(
        Path(config.tokenizer or backend.model_path), config.chat_template
    )
    servicer.tool_call_format, servicer.reasoning_format = output_formats(
        servicer.chat_template, config.tool_call_parser, config.reasoning_parser
    )
    if servicer.chat_template is not None:  # rendered in killable processes, probed now (template_renderer.py)
        renderer = TemplateRenderer(
            servicer.chat_template,
            max_bytes=max_text_bytes(config.max_prefill_tokens),
            timeout=config.chat_template_timeout,
            on_killed=lambda reason: metrics.CHAT_TEMPLATE_RENDERS_KILLED.labels(reason).inc(),
        )
        runtime.on_drain(renderer.close)  # first: a stop (or a failed start) kills renders in flight
        renderer.start()
        servicer.renderer = renderer
    _check_handoff_limits(config, capacity.max_handoff_tokens)
    attention, experts = _placements(config, capacity, backend.spec)
    planner = Planner(
        backend.spec,
        # rank 0's roofs, times the ranks: each has its own device, budget and link (docs/parallel.md)
        profile_from(capacity.expert_measurements, capacity.attention_measurements).with_gpus(capacity.ranks),
        # until requests come, MT-Bench's spread of prompt lengths around the expected one (as `plan`)
        Workload(
            config.expected_prompt_len,
            config.expected_gen_len,
            prompt_std=config.expected_prompt_len * MTBENCH_PROMPT_STD / MTBENCH_PROMPT_LEN,
        ),
        capacity.weight_dtype,
        capacity.kv_cache(Side.HOST).tokens,
        PlannerConfig(patience=10**9) if config.no_replan else None,
        attention=attention,
        experts=experts,
        quant=capacity.expert_scheme,
        device_kv_tokens=capacity.kv_cache(Side.DEVICE).tokens,
        resident_experts=capacity.resident_experts,
        max_micro_batch=capacity.max_handoff_tokens,
        kv_dtype=capacity.kv_dtype,
        kv_rule=KV_RULE_FOR_ADMISSION[config.kv_admission],
        kv_block_size=capacity.block_size,
        expert_groups=EXPERT_GROUP_CHOICES if config.expert_groups is None else (config.expert_groups,),
    )
    planner.fix(config.max_batch_size, config.micro_batch_size, config.prefill_budget, config.expert_groups)
    pages.planner = planner
    policy = planner.policy
    kv = capacity.kv_cache(policy.attention)  # the cache attention reads: its KV lives there for good
    schedule = SchedulerConfig(
        config.max_batch_size if config.max_batch_size is not None else policy.batch,
        config.micro_batch_size if config.micro_batch_size is not None else policy.micro_batch_size,
        config.max_queue if config.max_queue is not None else default_max_queue(config.max_batch_size),
        config.max_prefill_tokens,
        config.kv_admission,
        config.step_schedule,
        config.prefill_budget
        if config.prefill_budget is not None
        else prefill_budget(planner.estimate, config.max_prefill_tokens),
        config.expert_groups if config.expert_groups is not None else policy.expert_groups,
        mask_overlap=not config.no_grammar_mask_overlap,
    )
    log.info(
        "planned",
        batch_size=policy.batch,
        micro_batch_size=policy.micro_batch_size,
        predicted_decode_tokens_per_second=round(planner.estimate.tokens_per_second, 2),
        binding=planner.estimate.binding,
        placement=str(policy.placement),
        resident_experts=capacity.resident_experts,
        tensor_parallel_ranks=capacity.ranks,
        hardware=planner.profile.name,
        placements_predicted_tokens_per_second=planner.alternatives,
        in_force_batch=schedule.max_batch_size,
        in_force_micro_batch=schedule.micro_batch_size,
        kv_cache_dtype=kv.dtype,
        kv_cache_tokens=kv.tokens,
        kv_admission=config.kv_admission,
        step_schedule=config.step_schedule,
        prefill_budget=schedule.prefill_budget,
        expert_groups=schedule.expert_groups,
        kv_cache_sequences=planner.kv_cache_sequences,  # of the expected workload, by the admission's rule
    )
    planner.publish_in_force(schedule.max_batch_size, schedule.micro_batch_size, schedule.expert_groups)
    scheduler = Scheduler(
        backend.spec, backend, tokenizer, kv, schedule, None if config.no_replan else planner, policy.placement
    )
    servicer.scheduler, servicer.device, servicer.model_path = scheduler, capacity.device, backend.model_path
    servicer.kv_cache_dtype = kv.dtype
    supervisor = BackendSupervisor(backend, scheduler, runtime.set_serving, lambda c: c.kv_cache(policy.attention))
    runtime.on_drain(supervisor.stop)
    runtime.on_drain(lambda: scheduler.stop(config.drain_seconds))
    runtime.on_shutdown(backend.close)
    scheduler.start()
    supervisor.start()
    return {
        "address": config.address,
        "port": runtime.port,
        "kv_tokens": kv.tokens,
        "device": capacity.device,
        "tokenizer": tokenizer is not None,
        "chat_template": servicer.chat_template is not None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    config = OrchestratorConfig.from_cli_args(build_parser().parse_args(argv))
    backend = Backend(config.weight_store, config.gpu_expert, config.cpu_attention)
    servicer = GenerationServicer(workers=config.rpc_threads, stream_interval=config.stream_interval)
    pages = DebugPages(backend)
    limit = config.max_concurrent_rpcs or default_max_concurrent_rpcs(config.max_batch_size, config.max_queue)
    metrics.MAX_CONCURRENT_RPCS.set(limit)
    concurrency = AioConcurrencyLimit(
        limit, "--max-concurrent-rpcs", metrics.RPC_REFUSED.labels("concurrency").inc, metrics.RPCS_IN_PROGRESS
    )
    return serve_aio(
        config,
        "orchestrator",
        GENERATION,
        generation_pb2_grpc.add_GenerationServicer_to_server,
        servicer,
        lambda runtime: _start(config, backend, servicer, runtime, pages),
        grace_seconds=config.drain_seconds,
        # what a legal request can need, not 64 MiB: a bigger message is refused unread (RESOURCE_EXHAUSTED)
        max_receive_bytes=max_receive_bytes(config.max_prefill_tokens),
        pages=pages.routes(),  # /debug/...: the pipeline picture, live (orchestrator/debug.py)
        concurrency=concurrency,
    )


if __name__ == "__main__":
    sys.exit(main())
