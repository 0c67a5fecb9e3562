"""The model families we serve, one module each (docs/architecture.md, "Model families"): adding a
family is a new module whose `FAMILY` is listed here, and its tests."""

from __future__ import annotations

from typing import Any

from moe_lightning.families import dbrx, deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe
from moe_lightning.families.family import Family, Randoms, TopNames
from moe_lightning.hf_configs import ModelSpecError
from moe_lightning.spec import ModelSpec
from moe_lightning.spec_bounds import check_hf_config

FAMILIES: tuple[Family, ...] = (
    mixtral.FAMILY,
    olmoe.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    dbrx.FAMILY,
    glm4_moe.FAMILY,
    deepseek_v3.FAMILY,
    gpt_oss.FAMILY,
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)

__all__ = ["FAMILIES", "FAMILY_NAMES", "SUPPORTED_ARCHITECTURES", "Family", "Randoms", "TopNames"]


def by_name(name: str) -> Family:
    """The family users call `name` (`make-demo-model --family`)."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"unknown family {name!r}; choose one of {', '.join(FAMILY_NAMES)}")


def by_architecture(architecture: str) -> Family:
    for f in FAMILIES:
        if f.architecture == architecture:
            return f
    raise ModelSpecError(
        f"architectures[0] = {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def of_config(config: dict[str, Any]) -> Family:
    """The family of an HF config.json's dict: by architectures[0], else by model_type."""
    archs = config.get("architectures") or []
    if archs:
        return by_architecture(archs[0])
    model_type = config.get("model_type")
    for f in FAMILIES:
        if f.model_type == model_type:
            return f
    raise ModelSpecError(
        f"config.json names no 'architectures' and model_type {model_type!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec's fields from the dict of an HF config.json, by its family's reader, once its values'
    types and bounds are checked (spec_bounds.py)."""
    check_hf_config(config)
    family = of_config(config)
    return family.read_config(config, family.architecture)


def plan_presets() -> dict[str, ModelSpec]:
    """Every family's published shapes by name (`plan --arch`), in the registry's order."""
    return {name: spec for f in FAMILIES for name, spec in f.plan_presets.items()}
