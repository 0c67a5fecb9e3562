"""Head stage: final norm and logits, only for the rows that are sampled."""

import torch

from moe_lightning.spec import ModelSpec
from moe_lightning.stages.linear import linear
from moe_lightning.stages.norm import norm


def head_logits(spec: ModelSpec, final_norm: torch.Tensor, lm_head: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # hidden: (B, D), one row per sequence to sample -> logits (B, V) in fp32
    x = norm(spec, hidden, final_norm)  # (B, D)
    return linear(x, lm_head).float()  # (B, V)
