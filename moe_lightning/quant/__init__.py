"""Quantized expert pages: formats (scheme), round-to-nearest (rtn), GPTQ checkpoints (gptq), kernels."""

from typing import Any

from moe_lightning.quant.scheme import QuantFormat, QuantScheme, parse_quantize

__all__ = ["QuantFormat", "QuantScheme", "QuantizedLinear", "parse_quantize"]


def __getattr__(name: str) -> Any:
    # QuantizedLinear needs torch; the formats do not, and the command line parses --quantize without
    # paying torch's import (seconds) for `--help` or a refused flag
    if name == "QuantizedLinear":
        from moe_lightning.quant.linear import QuantizedLinear

        return QuantizedLinear
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
