"""How a KV cache stores K and V: the formats `--kv-dtype` names and what a token costs in each.

One definition for the cache that allocates (kv_cache.py), the benchmark that sizes it and the HRM
that plans by it (docs/kv-cache.md). No torch here: the planner and the command line import it.
"""

from __future__ import annotations

from moe_lightning.config.choices import DTYPE_NAMES

INT8 = "int8"  # 8-bit values with one scale per token per KV head (docs/kv-cache.md)
KV_FORMATS = (*DTYPE_NAMES, INT8)
VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, INT8: 1}
SCALE_BYTES = {INT8: 4}  # an fp32 scale per (token, KV head) of an int8 cache; none for the float formats
# symmetric int8: scale = absmax / INT8_MAX of a token's head, values rounded to nearest in [-127, 127]
# (-128 unused: the grid stays symmetric, so a head and its negation quantize alike)
INT8_MAX = 127


def check_format(fmt: str) -> str:
    """`fmt` itself when it names a KV format, else a ValueError listing the ones there are."""
    if fmt not in VALUE_BYTES:
        raise ValueError(f"KV format must be one of {', '.join(KV_FORMATS)}; got {fmt!r}")
    return fmt


def is_quantized(fmt: str) -> bool:
    """Whether a cache of `fmt` keeps scales beside its values (attention dequantizes what it reads)."""
    return check_format(fmt) in SCALE_BYTES


def bytes_per_head_token(fmt: str, head_dim: int) -> int:
    """K (or V) of one token in one KV head: its values and, for int8, its scale."""
    return head_dim * VALUE_BYTES[check_format(fmt)] + SCALE_BYTES.get(fmt, 0)


def bytes_per_token(fmt: str, num_layers: int, num_kv_heads: int, head_dim: int, tensors: int = 2) -> int:
    """K and V of one token across all layers (`tensors` 1: MLA's latent row, which is both)."""
    return tensors * num_layers * num_kv_heads * bytes_per_head_token(fmt, head_dim)
