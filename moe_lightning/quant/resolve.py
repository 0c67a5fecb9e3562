"""Which expert format a stack runs: `--quantize` against what the checkpoint already is."""

from __future__ import annotations

from pathlib import Path

from moe_lightning.quant.gptq_config import is_mxfp4_checkpoint, read_gptq_config
from moe_lightning.quant.scheme import QuantFormat, QuantScheme, parse_quantize


def resolve_scheme(model_dir: str | Path, quantize: str = "auto", group_size: int = 128) -> QuantScheme:
    """auto: the checkpoint's own format (a GPTQ checkpoint's int4, an MXFP4 one's mxfp4, else none). A
    GPTQ checkpoint loads only in its own format: widening it back or quantizing twice would lose what it
    holds. MXFP4 experts dequantize exactly (to the model dtype, or to be quantized to another format)."""
    if is_mxfp4_checkpoint(model_dir):
        return QuantScheme(QuantFormat.MXFP4) if quantize == "auto" else parse_quantize(quantize, group_size)
    gptq = read_gptq_config(model_dir)
    if gptq is None:
        return QuantScheme() if quantize == "auto" else parse_quantize(quantize, group_size)
    if quantize not in ("auto", QuantFormat.INT4.value):
        raise ValueError(
            f"{model_dir} is a 4-bit GPTQ checkpoint: its experts load as int4 pages (--quantize auto or int4), "
            f"not {quantize}"
        )
    return gptq.scheme
