"""Every value set a flag, an environment variable or a config field may take, defined once.

Parsers, the services' configs and the code that resolves `auto` all read these tuples; a test
(tests/test_config_flags.py) fails when a parser offers a different set. No torch here: the command
line, the planner and the HTTP gateway import this without paying torch's import.
"""

from __future__ import annotations

AUTO = "auto"

# the weights' and KV cache's floating-point dtypes (torch attribute names)
DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPE_CHOICES = (AUTO, *DTYPE_NAMES)  # auto: by device (moe_lightning.spec.resolve_dtype)
# the host KV cache's formats (kv_format.KV_FORMATS): the float dtypes, or int8 values with a scale per
# token per KV head (docs/kv-cache.md); auto: the weights' dtype
KV_DTYPE_CHOICES = (AUTO, *DTYPE_NAMES, "int8")

# how the scheduler takes KV blocks (orchestrator/batcher.py); the first is the default
KV_ADMISSIONS = ("need", "reserve")
# what one step runs (orchestrator/batcher.py): decodes and prefill chunks together, or one or the other
STEP_SCHEDULES = ("mixed", "alternating")
# a layer's expert FFNs once per micro-batch (0) or once per group of them (2: two groups ping-ponging):
# what the HRM picks among when --expert-groups is auto (services/gpu_expert/schedule.py)
EXPERT_GROUP_CHOICES = (0, 2)

# the expert pages' format (docs/quantization.md)
QUANTIZE_FORMATS = ("none", "int8", "int4", "mxfp4")
QUANTIZE_CHOICES = (AUTO, *QUANTIZE_FORMATS)  # auto: the checkpoint's own (int4 for GPTQ, mxfp4 for MXFP4, else none)
INT4_GROUP_SIZES = (128, 64, 32)  # tried in this order when no group size is given
PER_ROW_GROUP = -1  # one int4 group per row

# where attention and non-resident experts run (docs/hrm.md); auto: the HRM picks
ATTENTION_PLACEMENTS = (AUTO, "cpu", "gpu")
EXPERTS_PLACEMENTS = (AUTO, "gpu", "cpu")

EXPERT_KERNELS = ("fastest", "exact")  # gpu_expert's quantized GEMMs
QUANTIZE_DENSE = ("none", "int8")  # gpu_expert's attention projections and LM head
TP_BACKENDS = (AUTO, "nccl", "gloo")  # the ranks' all-reduces; auto: NCCL on CUDA, gloo on CPU
DEVICE_TYPES = ("cpu", "cuda")  # a device is one of these, cuda with an optional :index
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # any case on the command line

# how a model writes tool calls and its reasoning (moe_lightning/tool_calls.py, reasoning.py); the
# parsers' auto reads it from the chat template, none parses nothing. GPT-OSS's harmony messages are
# `harmony` (vLLM's tool parser `openai`) and `gpt_oss` (vLLM's reasoning parser `openai_gptoss`)
TOOL_CALL_FORMATS = ("hermes", "mistral", "llama3_json", "harmony")
TOOL_CALL_PARSERS = (AUTO, "none", *TOOL_CALL_FORMATS)
REASONING_FORMATS = ("qwen3", "deepseek_r1", "gpt_oss")
REASONING_PARSERS = (AUTO, "none", *REASONING_FORMATS)
