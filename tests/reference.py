"""transformers as the exactness reference, and small checkpoints made with its own classes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_hf_mixtral(out: Path, seed: int = 0, **overrides: Any) -> Path:
    """Random-weight MixtralForCausalLM saved with transformers' own save_pretrained."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**overrides)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to ones; perturb them so misplaced norms show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


def load_hf(model_dir: Path) -> Any:
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the raw last-position logits of each step, by a full forward every step.

    No KV cache on the reference side: slower, but independent of transformers' cache API and of
    our own paging.
    """
    ids = list(prompt)
    tokens, logits = [], []
    for _ in range(steps):
        out = model(torch.tensor([ids])).logits[0, -1].float()
        logits.append(out)
        tokens.append(int(out.argmax()))
        ids.append(tokens[-1])
    return tokens, logits
