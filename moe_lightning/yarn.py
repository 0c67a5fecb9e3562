"""YaRN's RoPE scaling as data (no torch): what a config's rope_parameters say, which the spec carries
and stages/rope.py computes frequencies and factors from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """rope_parameters {"rope_type": "yarn", ...}, field for field. transformers tests `mscale` and
    `mscale_all_dim` by truth value: 0 here is "absent" there."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: derived from factor, mscale and mscale_all_dim
    truncate: bool = True
