"""orchestrator: the public Generation API, tokenization, the request queue and batcher, and the
driver that runs each step across gpu_expert and cpu_attention."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_lightning.api.generation.v1 import generation_pb2_grpc
from moe_lightning.chat_template import ChatTemplate
from moe_lightning.flags import EnvDefaultsParser, add_batch_flags, add_service_flags, positive_int
from moe_lightning.hrm.costmodel import Workload
from moe_lightning.hrm.measurements import profile_from
from moe_lightning.placement import Side
from moe_lightning.service.aio_runtime import AioServiceRuntime, serve_aio
from moe_lightning.service.concurrency import AioConcurrencyLimit
from moe_lightning.service.names import GENERATION
from moe_lightning.spec import ModelSpec
from moe_lightning.template_renderer import DEFAULT_TIMEOUT, TemplateRenderer
from moe_lightning.tokenizer import TextTokenizer
from moe_lightning.validation import max_text_bytes
from orchestrator import metrics
from orchestrator.api import MAX_BATCH_PROMPTS, GenerationServicer, max_receive_bytes
from orchestrator.backend import Backend, Capacity
from orchestrator.debug import DebugPages
from orchestrator.planner import Planner, PlannerConfig
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.supervisor import BackendSupervisor


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-orchestrator", description=__doc__)
    add_service_flags(p, "127.0.0.1:50051")
    p.add_argument("--weight-store", required=True, help="address of the weight store")
    p.add_argument("--gpu-expert", required=True, help="address of gpu_expert")
    p.add_argument("--cpu-attention", required=True, help="address of cpu_attention")
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="directory with tokenizer.json (default: the model directory the weight store serves)",
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        help="a Jinja chat template file for `messages` prompts (default: the one in the model's "
        "tokenizer_config.json, if any)",
    )
    try:
        p.add_argument(
            "--chat-template-timeout",
            type=_render_seconds,  # checked as it is parsed: not after the backend connected, nor only with a template
            default=DEFAULT_TIMEOUT,
            help="seconds a chat template may take to render one conversation before the request is refused "
            "(INVALID_ARGUMENT) and its renderer process killed",
        )
    except argparse.ArgumentTypeError as exc:  # MOE_LIGHTNING_CHAT_TEMPLATE_TIMEOUT, typed as the flag is added
        p.error(f"MOE_LIGHTNING_CHAT_TEMPLATE_TIMEOUT (--chat-template-timeout): {exc}")
    add_batch_flags(p)
    p.add_argument(
        "--expected-prompt-len",
        type=float,
        default=77.0,
        help="average prompt tokens to plan for until requests are seen",
    )
    p.add_argument("--expected-gen-len", type=int, default=64, help="generated tokens to plan for until seen")
    p.add_argument("--no-replan", action="store_true", help="keep the start-up plan; never correct or re-plan")
    p.add_argument("--tls-cert", type=Path, default=None, help="serve the public API over TLS with this PEM cert")
    p.add_argument("--tls-key", type=Path, default=None, help="the PEM private key of --tls-cert")
    p.add_argument(
        "--auth-token",
        default=None,
        help="require 'authorization: Bearer TOKEN' on every call but health and reflection "
        "(better set as MOE_LIGHTNING_AUTH_TOKEN than on the command line)",
    )
    p.add_argument(
        "--attention-placement",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="where attention runs: the attention service next to the host KV cache (cpu), gpu_expert "
        "over its own KV cache (gpu; needs its --device-kv-memory), or whichever the HRM picks (auto)",
    )
    p.add_argument(
        "--experts-placement",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="where non-resident experts compute: streamed to the device (gpu), on the host where they "
        "live (cpu; on a CPU-only machine that is the zero-copy mode), or whichever the HRM picks (auto)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests that may wait before RESOURCE_EXHAUSTED (default: the largest batch this server may plan, "
        f"the HRM's cap of {PlannerConfig().batch_cap} or --max-batch-size if larger, plus two BatchGenerate calls "
        f"of {MAX_BATCH_PROMPTS}: room for a client that keeps the whole planned batch, rounded up to whole "
        "calls, and one more call queued)",
    )
    p.add_argument(
        "--max-concurrent-rpcs",
        type=positive_int,
        default=None,
        help="calls of the public API in progress at once (health and reflection aside) before one more is "
        "refused with RESOURCE_EXHAUSTED, counted in moe_lightning_rpc_refused_total (default: every request "
        "the server may hold as a call of its own, the largest batch it may plan plus --max-queue, so it "
        "refuses no call the queue would take; a list of prompts is one BatchGenerate call)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=8192,
        help="prompt tokens per prefill micro-batch; also the longest prompt accepted",
    )
    p.add_argument(
        "--rpc-threads",
        type=int,
        default=8,
        help="threads that check and tokenise requests; calls are served by an event loop, and a call waiting "
        "for its tokens holds no thread (--max-queue bounds the waiting work)",
    )
    p.add_argument("--drain-seconds", type=float, default=30.0, help="on SIGTERM, time to finish in-flight requests")
    p.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="GenerateStream (and the gateway's streams) send a message once this many tokens are new: 1, a "
        "message per decode step; larger, fewer messages and less CPU per token for the server and each reader "
        "(a request may ask for its own, GenerateStreamRequest.stream_interval; docs/api.md)",
    )
    return p


def _render_seconds(value: str) -> float:
    """--chat-template-timeout: a finite number of seconds over 0 (0 would refuse every chat, and an
    infinite one would let a looping template hold a renderer for good)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


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


def _check_handoff_limits(args: argparse.Namespace, max_tokens: int) -> None:
    """A micro-batch must fit one hand-off slot; the workers size theirs (--max-tokens-per-handoff)."""
    limits = (("--max-prefill-tokens", args.max_prefill_tokens), ("--micro-batch-size", args.micro_batch_size))
    for flag, value in limits:
        if value is not None and value > max_tokens:
            raise ValueError(
                f"{flag} {value} exceeds the {max_tokens} tokens one hand-off carries; lower it, or start "
                f"gpu_expert and cpu_attention with --max-tokens-per-handoff {value}"
            )


def _placements(args: argparse.Namespace, capacity: Capacity, spec: ModelSpec) -> tuple[tuple[Side, ...], ...]:
    """The placements the planner may choose from: what the services support, narrowed by the flags."""
    attention, experts = capacity.placements(spec)
    chosen = []
    for flag, supported, why in (
        (args.attention_placement, attention, "gpu_expert has no device KV cache (--device-kv-memory)"),
        (args.experts_placement, experts, "gpu_expert has no room to stream experts within --device-memory"),
    ):
        if flag == "auto":
            chosen.append(supported)
        elif flag in supported:
            chosen.append((Side(flag),))
        else:
            raise ValueError(f"placement {flag!r} is not available: {why}; available: {', '.join(supported)}")
    return tuple(chosen)


def _start(
    args: argparse.Namespace,
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
    tokenizer = TextTokenizer.from_model_dir(args.tokenizer or backend.model_path)
    if tokenizer is not None:
        tokenizer.check_fits(backend.spec.vocab_size, args.tokenizer or backend.model_path)
    servicer.chat_template = ChatTemplate.from_model_dir(Path(args.tokenizer or backend.model_path), args.chat_template)
    if servicer.chat_template is not None:  # rendered in killable processes, probed now (template_renderer.py)
        renderer = TemplateRenderer(
            servicer.chat_template,
            max_bytes=max_text_bytes(args.max_prefill_tokens),
            timeout=args.chat_template_timeout,
            on_killed=lambda reason: metrics.CHAT_TEMPLATE_RENDERS_KILLED.labels(reason).inc(),
        )
        runtime.on_drain(renderer.close)  # first: a stop (or a failed start) kills renders in flight
        renderer.start()
        servicer.renderer = renderer
    _check_handoff_limits(args, capacity.max_handoff_tokens)
    attention, experts = _placements(args, capacity, backend.spec)
    planner = Planner(
        backend.spec,
        # rank 0's roofs, times the ranks: each has its own device, budget and link (docs/parallel.md)
        profile_from(capacity.expert_measurements, capacity.attention_measurements).with_gpus(capacity.ranks),
        Workload(args.expected_prompt_len, args.expected_gen_len),
        capacity.weight_dtype,
        capacity.kv_cache(Side.HOST).tokens,
        PlannerConfig(patience=10**9) if args.no_replan else None,
        attention=attention,
        experts=experts,
        quant=capacity.expert_scheme,
        device_kv_tokens=capacity.kv_cache(Side.DEVICE).tokens,
        resident_experts=capacity.resident_experts,
        max_micro_batch=capacity.max_handoff_tokens,
        kv_dtype=capacity.kv_dtype,
    )
    planner.fixed_batch, planner.fixed_micro_batch = args.max_batch_size, args.micro_batch_size
    pages.planner = planner
    policy = planner.policy
    kv = capacity.kv_cache(policy.attention)  # the cache attention reads: its KV lives there for good
    config = SchedulerConfig(
        args.max_batch_size if args.max_batch_size is not None else policy.batch,
        args.micro_batch_size if args.micro_batch_size is not None else policy.micro_batch,
        args.max_queue if args.max_queue is not None else default_max_queue(args.max_batch_size),
        args.max_prefill_tokens,
    )
    log.info(
        "planned",
        batch_size=policy.batch,
        micro_batch_size=policy.micro_batch,
        predicted_decode_tokens_per_second=round(planner.estimate.tokens_per_second, 2),
        binding=planner.estimate.binding,
        placement=str(policy.placement),
        resident_experts=capacity.resident_experts,
        tensor_parallel_ranks=capacity.ranks,
        hardware=planner.profile.name,
        placements_predicted_tokens_per_second=planner.alternatives,
        in_force_batch=config.max_batch_size,
        in_force_micro_batch=config.micro_batch_size,
        kv_cache_dtype=kv.dtype,
        kv_cache_sequences=kv.tokens // int(planner.workload.max_context),  # of the expected s + n tokens
    )
    scheduler = Scheduler(
        backend.spec, backend, tokenizer, kv, config, None if args.no_replan else planner, policy.placement
    )
    servicer.scheduler, servicer.device, servicer.model_path = scheduler, capacity.device, backend.model_path
    servicer.kv_cache_dtype = kv.dtype
    supervisor = BackendSupervisor(backend, scheduler, runtime.set_serving, lambda c: c.kv_cache(policy.attention))
    runtime.on_drain(supervisor.stop)
    runtime.on_drain(lambda: scheduler.stop(args.drain_seconds))
    runtime.on_shutdown(backend.close)
    scheduler.start()
    supervisor.start()
    return {
        "address": args.address,
        "port": runtime.port,
        "kv_tokens": kv.tokens,
        "device": capacity.device,
        "tokenizer": tokenizer is not None,
        "chat_template": servicer.chat_template is not None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backend = Backend(args.weight_store, args.gpu_expert, args.cpu_attention)
    servicer = GenerationServicer(workers=args.rpc_threads, stream_interval=args.stream_interval)
    pages = DebugPages(backend)
    limit = args.max_concurrent_rpcs or default_max_concurrent_rpcs(args.max_batch_size, args.max_queue)
    metrics.MAX_CONCURRENT_RPCS.set(limit)
    concurrency = AioConcurrencyLimit(
        limit, "--max-concurrent-rpcs", metrics.RPC_REFUSED.labels("concurrency").inc, metrics.RPCS_IN_PROGRESS
    )
    return serve_aio(
        args,
        "orchestrator",
        GENERATION,
        generation_pb2_grpc.add_GenerationServicer_to_server,
        servicer,
        lambda runtime: _start(args, backend, servicer, runtime, pages),
        grace_seconds=args.drain_seconds,
        # what a legal request can need, not 64 MiB: a bigger message is refused unread (RESOURCE_EXHAUSTED)
        max_receive_bytes=max_receive_bytes(args.max_prefill_tokens),
        pages=pages.routes(),  # /debug/...: the pipeline picture, live (orchestrator/debug.py)
        concurrency=concurrency,
    )


if __name__ == "__main__":
    sys.exit(main())
