"""Rotary position embeddings at each token's own position (ragged batches have no shared offset)."""

import torch


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: (T,) -> cos, sin: (T, Hd)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, Hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, Hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, Hd), cos/sin: (T, Hd)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
