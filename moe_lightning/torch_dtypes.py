"""The weights' and KV cache's dtype names (config/choices.py) as torch dtypes.

A module of its own so that the ones that need no torch (the spec, the command line, the planner,
the HTTP gateway) never import it: only code that already computes in torch does.
"""

from __future__ import annotations

import torch

from moe_lightning.config.choices import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
