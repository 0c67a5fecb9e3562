"""What a model's weights and KV cache weigh, and how many experts a batch touches: the sizes the
per-layer cost (hrm/layercost.py, which re-exports them) is built from."""

from __future__ import annotations

from moe_lightning.config.choices import DTYPE_NAMES
from moe_lightning.kv_format import KV_FORMATS, VALUE_BYTES, bytes_per_head_token
from moe_lightning.quant.scheme import QuantScheme
from moe_lightning.spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # keyed by config/choices.py DTYPE_NAMES
NO_QUANT = QuantScheme()  # expert pages in the model dtype


def dtype_bytes(name: str, what: str = "dtype") -> int:
    """Bytes per element of a resolved dtype. 'auto' is the commands' to resolve (by device) before
    planning: the model cannot guess it, so it says so instead of failing on a lookup."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"the HRM needs a resolved {what}, one of {', '.join(DTYPE_NAMES)}; got {name!r}")
    return DTYPE_BYTES[name]


def kv_token_bytes(spec: ModelSpec, kv_format: str) -> int:
    """K and V of one token in one layer in a KV format (kv_format.py: an int8 cache adds its scales)."""
    if kv_format not in VALUE_BYTES:
        raise ValueError(f"the HRM needs a resolved kv_dtype, one of {', '.join(KV_FORMATS)}; got {kv_format!r}")
    return spec.kv_tensors * spec.num_kv_heads * bytes_per_head_token(kv_format, spec.head_dim)


def distinct_experts(tokens: float, spec: ModelSpec) -> float:
    """Expected experts touched by `tokens` tokens routing uniformly to top-k of E."""
    e, k = spec.num_experts, spec.top_k
    return e * (1.0 - (1.0 - k / e) ** tokens)


def sparse_share(spec: ModelSpec) -> float:
    """The share of layers with experts; the rest (Qwen-MoE's dense layers) run one dense MLP. The
    model is per layer, so per-layer expert and MLP work is this share's average over all layers."""
    return spec.num_sparse_layers / spec.num_layers


def page_bytes_per_weight(spec: ModelSpec, b: int, quant: QuantScheme = NO_QUANT) -> float:
    """Average bytes per weight of an expert page: w13 (2I, D) has D inputs per row, w2 (D, I) has I;
    an expert's biases (GPT-OSS: 2I + D in the model dtype) spread over its 3DI weights."""
    h1, h2 = spec.hidden_size, spec.intermediate_size
    biases = (2 * h2 + h1) * b / (3 * h1 * h2) if spec.expert_bias else 0.0
    return (2 * quant.bytes_per_weight(h1, b) + quant.bytes_per_weight(h2, b)) / 3 + biases


def weight_bytes(spec: ModelSpec, b: int, quant: QuantScheme = NO_QUANT) -> dict[str, float]:
    h1, h2, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    pb = page_bytes_per_weight(spec, b, quant)
    attn = (
        spec.attention_params() if spec.attention == "mla" else h1 * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h1
    )
    f = sparse_share(spec)
    # a shared expert (Qwen2-MoE) computes for every token: dense work, always on the device; so
    # does a dense layer's MLP
    ffn_dense = f * (e * h1 + 3 * h1 * spec.shared_expert_size) + (1 - f) * 3 * h1 * spec.dense_intermediate_size
    return {
        "expert": 3 * h1 * h2 * pb,  # one expert page
        "layer_experts": 3 * h1 * h2 * e * pb,  # W_l of a sparse layer
        "layer_dense": (attn + 2 * h1 + ffn_dense) * b,  # averaged over the layers
        "embed_head": spec.vocab_size * h1 * b * (1 if spec.tie_word_embeddings else 2) + h1 * b,
    }
