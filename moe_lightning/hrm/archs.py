"""Shapes of the models the paper evaluates, and of the other supported families, for planning
without a checkpoint (bf16): each family's published presets (moe_lightning/families/)."""

from __future__ import annotations

from moe_lightning.families import plan_presets
from moe_lightning.spec import ModelSpec

ARCHS: dict[str, ModelSpec] = plan_presets()
