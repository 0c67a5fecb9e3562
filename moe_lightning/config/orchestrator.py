"""The orchestrator's config: its three workers, the public API's exposure and limits, and the
HRM's starting assumptions."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from moe_lightning.config import flags
from moe_lightning.config.choices import AUTO, KV_ADMISSIONS, STEP_SCHEDULES
from moe_lightning.config.flag import REQUIRED, Flag, option
from moe_lightning.config.service import ServiceConfig
from moe_lightning.config.units import positive_int

DEFAULT_ADDRESS = "127.0.0.1:50051"
CHAT_TEMPLATE_TIMEOUT = 2.0  # seconds a render may take


def render_seconds(value: str) -> float:
    """--chat-template-timeout: a finite number of seconds over 0 (0 would refuse every chat, and an
    infinite one would let a looping template hold a renderer for good)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


GPU_EXPERT = Flag("--gpu-expert", "address of gpu_expert")
CPU_ATTENTION = Flag("--cpu-attention", "address of cpu_attention")
TOKENIZER = Flag(
    "--tokenizer", "directory with tokenizer.json (default: the model directory the weight store serves)", type=Path
)
CHAT_TEMPLATE_TIMEOUT_FLAG = Flag(
    "--chat-template-timeout",
    "seconds a chat template may take to render one conversation before the request is refused "
    "(INVALID_ARGUMENT) and its renderer process killed",
    type=render_seconds,
)
EXPECTED_PROMPT_LEN = Flag(
    "--expected-prompt-len", "average prompt tokens to plan for until requests are seen", type=float
)
EXPECTED_GEN_LEN = Flag("--expected-gen-len", "generated tokens to plan for until seen", type=int)
NO_REPLAN = Flag("--no-replan", "keep the start-up plan; never correct or re-plan", action="store_true")
NO_GRAMMAR_MASK_OVERLAP = Flag(
    "--no-grammar-mask-overlap",
    "fill structured-output requests' token masks before each step is sent (the old way: every step waits for "
    "them), not while its layers run",
    action="store_true",
)
MAX_QUEUE = Flag(
    "--max-queue",
    "requests that may wait before RESOURCE_EXHAUSTED (default: the largest batch this server may plan, the HRM's "
    "cap or --max-batch-size if larger, plus two BatchGenerate calls of the most prompts one may carry: room for a "
    "client that keeps the whole planned batch, rounded up to whole calls, and one more call queued)",
    type=int,
)
MAX_CONCURRENT_RPCS = Flag(
    "--max-concurrent-rpcs",
    "calls of the public API in progress at once (health and reflection aside) before one more is refused with "
    "RESOURCE_EXHAUSTED, counted in moe_lightning_rpc_refused_total (default: every request the server may hold as "
    "a call of its own, the largest batch it may plan plus --max-queue, so it refuses no call the queue would take; "
    "a list of prompts is one BatchGenerate call)",
    type=positive_int,
)
MAX_PREFILL_TOKENS = Flag(
    "--max-prefill-tokens", "prompt tokens per prefill micro-batch; also the longest prompt accepted", type=int
)
RPC_THREADS = Flag(
    "--rpc-threads",
    "threads that check and tokenise requests; calls are served by an event loop, and a call waiting for its "
    "tokens holds no thread (--max-queue bounds the waiting work)",
    type=int,
)
DRAIN_SECONDS = Flag("--drain-seconds", "on SIGTERM, time to finish in-flight requests", type=float)


@dataclass(kw_only=True)
class OrchestratorConfig(ServiceConfig):
    address: str = option(flags.ADDRESS, DEFAULT_ADDRESS)
    weight_store: str = option(flags.WEIGHT_STORE, REQUIRED)
    gpu_expert: str = option(GPU_EXPERT, REQUIRED)
    cpu_attention: str = option(CPU_ATTENTION, REQUIRED)
    tokenizer: Path | None = option(TOKENIZER)
    chat_template: Path | None = option(flags.CHAT_TEMPLATE)
    chat_template_timeout: float = option(CHAT_TEMPLATE_TIMEOUT_FLAG, CHAT_TEMPLATE_TIMEOUT)
    tool_call_parser: str = option(flags.TOOL_CALL_PARSER, AUTO)
    reasoning_parser: str = option(flags.REASONING_PARSER, AUTO)
    max_batch_size: int | None = option(flags.MAX_BATCH_SIZE)  # None: the HRM's policy
    micro_batch_size: int | None = option(flags.MICRO_BATCH_SIZE)  # None: the HRM's; 0: the whole batch
    expected_prompt_len: float = option(EXPECTED_PROMPT_LEN, 77.0)
    expected_gen_len: int = option(EXPECTED_GEN_LEN, 64)
    no_replan: bool = option(NO_REPLAN, False)
    no_grammar_mask_overlap: bool = option(NO_GRAMMAR_MASK_OVERLAP, False)
    tls_cert: Path | None = option(flags.TLS_CERT)
    tls_key: Path | None = option(flags.TLS_KEY)
    auth_token: str | None = option(flags.AUTH_TOKEN)
    attention_placement: str = option(flags.ATTENTION_PLACEMENT, "auto")
    experts_placement: str = option(flags.EXPERTS_PLACEMENT, "auto")
    max_queue: int | None = option(MAX_QUEUE)
    max_concurrent_rpcs: int | None = option(MAX_CONCURRENT_RPCS)
    max_prefill_tokens: int = option(MAX_PREFILL_TOKENS, 8192)
    kv_admission: str = option(flags.KV_ADMISSION, KV_ADMISSIONS[0])
    step_schedule: str = option(flags.STEP_SCHEDULE, STEP_SCHEDULES[0])
    prefill_budget: int | None = option(flags.PREFILL_BUDGET)  # None: the HRM's (hrm/prefill_budget.py)
    expert_groups: int | None = option(flags.EXPERT_GROUPS)  # None: the HRM picks (0: per micro-batch)
    rpc_threads: int = option(RPC_THREADS, 8)
    drain_seconds: float = option(DRAIN_SECONDS, 30.0)
    stream_interval: int = option(flags.STREAM_INTERVAL, 1)
