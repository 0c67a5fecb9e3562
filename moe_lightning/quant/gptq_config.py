"""What a GPTQ checkpoint says of itself (its quantization config), read without torch: the launcher
and `plan` resolve --quantize auto from it before anything heavy is imported (config/checks.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.families import of_config
from moe_lightning.quant.scheme import QuantFormat, QuantScheme

QUANTIZE_CONFIG = "quantize_config.json"
# what is added to a stored zero point to get the one the weights were quantized with
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}
SUPPORTED = "4-bit GPTQ (quant_method gptq, checkpoint_format gptq or gptq_v2) or MXFP4 (quant_method mxfp4)"


@dataclass(frozen=True, slots=True)
class GPTQConfig:
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    quant_method: str = "gptq"
    static_groups: bool = False

    @property
    def act_order(self) -> bool:
        # static groups are formed before the act-order pass, so g_idx stays k // G
        return self.desc_act and not self.static_groups

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(QuantFormat.INT4, self.group_size, act_order=self.act_order)

    @property
    def zero_offset(self) -> int:
        return ZERO_OFFSET[self.checkpoint_format]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def _field(raw: dict[str, Any], name: str, kind: type, default: Any, source: str) -> Any:
    value = raw.get(name, default)
    if value is None:
        value = default
    # bool is an int subclass: `"bits": true` is a mistake, not 1
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"{source}: {name} must be {kind.__name__}, got {value!r}")
    return value


MXFP4_METHOD = "mxfp4"  # GPT-OSS's published experts (quant/mxfp4.py): their pages load as they are


def is_mxfp4_checkpoint(model_dir: str | Path) -> bool:
    """Whether config.json's quantization_config says MXFP4 (quant_method "mxfp4", as GPT-OSS ships)."""
    path = Path(model_dir) / "config.json"
    config = _read_json(path) if path.is_file() else {}
    raw = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(raw, dict) and str(raw.get("quant_method", "")).lower() == MXFP4_METHOD


def read_gptq_config(model_dir: str | Path) -> GPTQConfig | None:
    """The checkpoint's GPTQ settings; None when it is not quantized, or quantized as MXFP4 (read by the
    family's loader). Anything else quantized that we cannot run (another method, other bits, another
    packing, DBRX) is a CheckpointError saying which."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    if config.get("quantization_config") is not None:  # what transformers reads first
        raw, source = config["quantization_config"], f"{config_path} quantization_config"
        if not isinstance(raw, dict) or "quant_method" not in raw:
            raise CheckpointError(f"{source}: no quant_method; moe-lightning loads {SUPPORTED}")
    elif (model_dir / QUANTIZE_CONFIG).is_file():
        raw, source = _read_json(model_dir / QUANTIZE_CONFIG), str(model_dir / QUANTIZE_CONFIG)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: not a JSON object")
        raw = {"quant_method": "gptq", **raw}  # AutoGPTQ's early files have no method field
    else:
        return None
    method = raw["quant_method"]
    if isinstance(method, str) and method.lower() == MXFP4_METHOD:
        return None
    if not isinstance(method, str) or method.lower() != "gptq":
        raise CheckpointError(
            f"{source}: quant_method {method!r} is not supported; moe-lightning loads {SUPPORTED} "
            "or unquantized checkpoints"
        )
    why = _family_cannot(config)
    if why is not None:
        raise CheckpointError(f"{source}: a GPTQ {config.get('model_type')} checkpoint is not supported: {why}")
    bits = _field(raw, "bits", int, None, source) if "bits" in raw else None
    if bits != 4:
        raise CheckpointError(f"{source}: GPTQ with bits={bits} is not supported; moe-lightning loads {SUPPORTED}")
    group_size = _field(raw, "group_size", int, 128, source)
    if group_size != -1 and group_size <= 0:
        raise CheckpointError(f"{source}: group_size must be positive or -1, got {group_size}")
    fmt = raw.get("checkpoint_format", raw.get("format")) or "gptq"
    if raw.get("is_marlin_format"):  # AutoGPTQ's flag for Marlin-repacked weights
        fmt = "marlin"
    if fmt not in ZERO_OFFSET:
        raise CheckpointError(
            f"{source}: GPTQ checkpoint_format {fmt!r} is not supported; moe-lightning loads {SUPPORTED}"
        )
    return GPTQConfig(
        bits=bits,
        group_size=group_size,
        desc_act=_field(raw, "desc_act", bool, False, source),
        sym=_field(raw, "sym", bool, True, source),
        checkpoint_format=fmt,
        static_groups=_field(raw, "static_groups", bool, False, source),
    )


def _family_cannot(config: dict[str, Any]) -> str | None:
    """Why the config's family cannot load from GPTQ (its `gptq_unsupported`); None when it can, or
    when the family is unknown (the spec names that problem)."""
    try:
        return of_config(config).gptq_unsupported
    except ValueError:
        return None
