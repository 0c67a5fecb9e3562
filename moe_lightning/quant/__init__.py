"""Quantized expert pages: formats (scheme), round-to-nearest (rtn), GPTQ checkpoints (gptq), kernels."""

from moe_lightning.quant.linear import QuantizedLinear
from moe_lightning.quant.scheme import QuantFormat, QuantScheme, parse_quantize

__all__ = ["QuantFormat", "QuantScheme", "QuantizedLinear", "parse_quantize"]
