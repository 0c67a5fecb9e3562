"""The flags more than one process or command offers, each declared here once.

A flag only one process offers is declared beside that process's config (config/<process>.py); a
flag only one command offers, in the command. tests/test_config_flags.py walks every parser and
fails on a flag declared twice or a choice set other than config/choices.py's.
"""

from __future__ import annotations

from pathlib import Path

from moe_lightning.config import choices
from moe_lightning.config.flag import Flag
from moe_lightning.config.host_memory import parse_kv_cache_memory
from moe_lightning.config.units import (
    non_negative_int,
    parse_device,
    parse_device_memory,
    parse_expert_groups,
    parse_formats,
    parse_rate,
    parse_size,
    positive_int,
)

# --- the model and its numerics
MODEL = Flag("--model", "HF checkpoint directory", type=Path)
DEVICE = Flag("--device", "the device expert FFNs run on: cpu, cuda or cuda:N", type=parse_device)
DTYPE = Flag(
    "--dtype",
    "dtype of the weights (in the arena and on the device); auto: float32 on a CPU device, else the checkpoint's "
    "16-bit dtype (bfloat16 for a float32 checkpoint)",
    choices=choices.DTYPE_CHOICES,
)
KV_DTYPE = Flag(
    "--kv-dtype",
    "format cpu_attention's KV cache stores K/V in (attention computes in fp32 over it; bf16/fp16 hold twice "
    "fp32's tokens; int8: 8-bit values with an fp32 scale per token per KV head, ~3.9x fp32's tokens at head dim "
    "128, dequantized chunk by chunk as attention reads them, docs/kv-cache.md); auto: the weights' dtype",
    choices=choices.KV_DTYPE_CHOICES,
)
QUANTIZE = Flag(
    "--quantize",
    "format of the expert pages: int8 (per-channel) or int4 (group-wise), quantized at load by rounding to nearest; "
    "none keeps the model's dtype; auto: the checkpoint's own (int4 for a GPTQ checkpoint, else none). Dense "
    "weights stay in the model's dtype",
    choices=choices.QUANTIZE_CHOICES,
)
QUANTIZE_DENSE = Flag(
    "--quantize-dense",
    "format of the attention projections (q/k/v, o) and the LM head where gpu_expert computes them: int8 "
    "(per-channel, rounded to nearest at load, as llama.cpp's q8_0 / q4_0 files also quantize them) or none "
    "(the model's dtype); the arena keeps them as they are (docs/quantization.md)",
    choices=choices.QUANTIZE_DENSE,
)
QUANTIZE_GROUP_SIZE = Flag(
    "--quantize-group-size",
    "int4 group size: 32, 64, 128, or -1 for one group per row (default: the largest of 128, 64, 32 that divides "
    "every width; a GPTQ checkpoint keeps its own)",
    type=int,
)
COMPARE_QUANTIZE = Flag(
    "--compare-quantize",
    "each expert page format of this comma-separated list side by side (alone: none,int8,int4,mxfp4; "
    "--quantize-group-size is int4's); bench runs each at the same --device-memory",
    type=parse_formats,
    nargs="?",
    const=choices.QUANTIZE_FORMATS,
    metavar="FORMATS",
)

# --- placement and the device's budget
ATTENTION_PLACEMENT = Flag(
    "--attention-placement",
    "where attention runs: cpu_attention next to the host KV cache (cpu), gpu_expert over its own KV cache (gpu; "
    "needs --device-kv-memory), or whichever the HRM picks (auto)",
    choices=choices.ATTENTION_PLACEMENTS,
)
EXPERTS_PLACEMENT = Flag(
    "--experts-placement",
    "where non-resident experts compute: streamed to the device (gpu), on the host where they live (cpu; on a "
    "CPU-only machine the zero-copy mode), or whichever the HRM picks (auto)",
    choices=choices.EXPERTS_PLACEMENTS,
)
DEVICE_MEMORY = Flag(
    "--device-memory",
    "gpu_expert's budget per device for weights and its KV cache, e.g. 16GiB, or the dense weights plus a share "
    "of the expert pages, e.g. 25%% (default: the device's free memory less what the CUDA runtime, the "
    "activations of the largest micro-batch and the head need)",
    type=parse_device_memory,
)
CAP_DEVICE_MEMORY = Flag(
    "--cap-device-memory",
    "--device-memory (bytes) bounds everything gpu_expert allocates on the device, not only its weights: the "
    "allocator is capped there and the weights get it less the activations' room (a baseline capped alike is "
    "then compared at one budget: bench/gpu_check.py)",
    action="store_true",
)
DEVICE_KV_MEMORY = Flag(
    "--device-kv-memory",
    "device memory for a KV cache in gpu_expert, so attention may run on the device (0: none)",
    type=parse_size,
)
KV_CACHE_MEMORY = Flag(
    "--kv-cache-memory",
    "host memory for cpu_attention's KV cache (--kv-dtype decides how many tokens fit); auto: 90%% of the host "
    "memory available at start (the arena loaded) less a reserve of 2 GiB or 10%% of the host, within /dev/shm's "
    "free space",
    type=parse_kv_cache_memory,
)
STEP_SCHEDULE = Flag(
    "--step-schedule",
    "mixed: every step decodes the running sequences and prefills prompts in chunks within --prefill-budget, one "
    "weight pass for both; alternating: a step prefills or decodes, as the paper's (docs/cgopipe-and-benchmarks.md)",
    choices=choices.STEP_SCHEDULES,
)
PREFILL_BUDGET = Flag(
    "--prefill-budget",
    "prompt tokens a mixed step takes on beside its decodes (default: the HRM's, the most a link-bound step carries "
    "for free; at most --max-prefill-tokens)",
    type=positive_int,
)
EXPERT_GROUPS = Flag(
    "--expert-groups",
    "how many groups of micro-batches run a layer's experts together, each expert read once per group: 0 once "
    "per micro-batch (CGOPipe's order), 2 two groups ping-ponging (host attention of one beside the device's "
    "experts of the other); auto: the HRM picks where it pays (docs/cgopipe-and-benchmarks.md)",
    type=parse_expert_groups,
)
KV_ADMISSION = Flag(
    "--kv-admission",
    "need: a sequence takes KV blocks as it grows, and the newest are preempted (re-prefilled later) when the "
    "cache runs out; reserve: the blocks of prompt + max_tokens are taken at admission, nothing is preempted, "
    "fewer sequences run (docs/kv-cache.md)",
    choices=choices.KV_ADMISSIONS,
)
GPUS = Flag(
    "--gpus",
    "gpu_expert's tensor-parallel ranks, one process per device (cuda:0, cuda:1, ...; on --device cpu they share "
    "the cores), each with its own --device-memory (docs/parallel.md)",
    type=positive_int,
)
LINK_BANDWIDTH = Flag(
    "--link-bandwidth",
    "with --device cpu: stream expert pages no faster than this (e.g. 2GB/s), as a PCIe link would; the copy thread "
    "sleeps out each page's time, and the HRM plans with this figure as its host-to-device bandwidth. Simulates "
    "the link only: device and host compute still share the CPU's cores",
    type=parse_rate,
    metavar="BYTES_PER_S",
)
EXPERT_KERNELS = Flag(
    "--expert-kernels",
    "quantized expert GEMMs: the fastest measured kernel per shape (some round activations or scales to bfloat16), "
    "or only those equal to the GEMM on the dequantized weights (in a 16-bit model: dequantize, then GEMM)",
    choices=choices.EXPERT_KERNELS,
)
RESIDENCY_INTERVAL = Flag(
    "--residency-interval",
    "decode steps between hot-expert residency updates when experts stream (0 = never)",
    type=int,
)
COUNT_SYNCS = Flag(
    "--count-syncs",
    "count gpu_expert's host synchronisations with the device in each step (for checks, slower: "
    "moe_lightning_host_syncs_total; on a CPU device, the reads that would be one on CUDA)",
    action="store_true",
)
BLOCK_SIZE = Flag("--block-size", "KV cache block size in tokens", type=positive_int)

# --- batching (unset: the orchestrator's HRM policy decides)
MAX_BATCH_SIZE = Flag("--max-batch-size", "requests decoded together (default: the HRM's policy)", type=positive_int)
MICRO_BATCH_SIZE = Flag(
    "--micro-batch-size",
    "sequences per micro-batch (default: the HRM's policy; 0 = the whole batch)",
    type=non_negative_int,
)

# --- logs (every process)
LOG_LEVEL = Flag("--log-level", "the least severe log lines written", type=str.lower, choices=choices.LOG_LEVELS)
LOG_JSON = Flag("--log-json", "JSON logs even on a terminal", action="store_true")

# --- wiring, identity and files of a stack
ADDRESS = Flag(
    "--address",
    "listen address: unix:///path.sock or host:port (an internal service on TCP needs --internal-token; the "
    "gateway and the orchestrator: host:port, port 0 = any free)",
)
WEIGHT_STORE = Flag("--weight-store", "address of the weight store")
RUN_ID = Flag("--run-id", "names this stack's shared-memory segments, so two stacks on one box do not collide")
CACHE_DIR = Flag(
    "--cache-dir",
    "where the weight store keeps its converted copy (default: ~/.cache/moe-lightning/arena; in a container, a volume)",
    type=Path,
)
NO_PROGRESS = Flag("--no-progress", "no progress bar", action="store_true")
CHAT_TEMPLATE = Flag(
    "--chat-template",
    "a Jinja chat template file for `messages` prompts (default: the one in the model's tokenizer_config.json, if any)",
    type=Path,
)
TOOL_CALL_PARSER = Flag(
    "--tool-call-parser",
    "how the model writes tool calls, for the OpenAI API's tools: auto reads it from the chat template "
    '(docs/openai.md, "Tools"); none parses none',
    choices=choices.TOOL_CALL_PARSERS,
)
REASONING_PARSER = Flag(
    "--reasoning-parser",
    "how the model writes its reasoning, returned apart as reasoning_content: auto reads it from the chat "
    "template; none returns it as content",
    choices=choices.REASONING_PARSERS,
)
STREAM_INTERVAL = Flag(
    "--stream-interval",
    "streams (gRPC and HTTP) send a message once this many tokens are new: 1, a message per decode step; larger, "
    "fewer messages and less CPU per token for the server and each reader (a request may ask for its own; "
    "docs/api.md)",
    type=positive_int,
)

# --- the public API's exposure
TLS_CERT = Flag("--tls-cert", "serve the public API (gRPC and HTTP) over TLS with this PEM certificate", type=Path)
TLS_KEY = Flag("--tls-key", "the PEM private key of --tls-cert", type=Path)
TLS_CA = Flag(
    "--tls-ca",
    "PEM root certificate that verifies the server's TLS certificate (up: for its own readiness check, default the "
    "cert itself, self-signed)",
    type=Path,
)
AUTH_TOKEN = Flag(
    "--auth-token",
    "bearer token of the public API: required from callers by the orchestrator and the gateway, sent by clients "
    "(set it as MOE_LIGHTNING_AUTH_TOKEN: ps shows the command line)",
    secret=True,
)
INSECURE = Flag(
    "--insecure",
    "allow a listen address beyond loopback without --auth-token (anyone who reaches the port may use the API)",
    action="store_true",
)

# --- what a command prints or writes
JSON = Flag("--json", "print JSON instead of text", action="store_true")
PNG = Flag("--png", "draw a few layers of one decode step (the pipeline picture) here", type=Path)
OUT = Flag(
    "--out",
    "where to write: the checkpoint directory (make-demo-model), a copy of the profile JSON (profile)",
    type=Path,
)
SEED = Flag(
    "--seed",
    "makes the output reproducible: the seed of the sampling stream (generate, run), of the weights and tokenizer "
    "(make-demo-model)",
    type=int,
)
ADDR = Flag("--addr", "HOST:PORT of a running stack's Generation API")
ARCH = Flag(
    "--arch", "a model the HRM knows by name: mixtral-8x7b, mixtral-8x22b, dbrx, olmoe-1b-7b, qwen1.5-moe-a2.7b, ..."
)
GEN_LEN = Flag("--gen-len", "tokens generated per request", type=positive_int)

__all__ = [name for name, value in dict(globals()).items() if isinstance(value, Flag)]
