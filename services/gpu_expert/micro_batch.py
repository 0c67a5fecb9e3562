"""One micro-batch of a step as the runner carries it through the layers."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from moe_lightning.service.errors import ServiceError
from moe_lightning.stages import embed_tokens
from moe_lightning.stages.attend import BatchPlans
from moe_lightning.step_protocol import SequenceWork


@dataclass(slots=True)
class MicroBatchState:
    works: list[SequenceWork]
    positions: torch.Tensor  # (T,)
    hidden: torch.Tensor  # (T, D)
    last_rows: torch.Tensor  # (B,)
    attention: BatchPlans | None = None  # set when attention runs here, over the device KV cache
    ffn_input: torch.Tensor | None = None  # (T, D) grouped experts: the FFN's input, waiting for the group

    @classmethod
    def embed(cls, mb: list[SequenceWork], embed: torch.Tensor, device: torch.device) -> MicroBatchState:
        tokens = to_device(torch.tensor([t for w in mb for t in w.token_ids], dtype=torch.long), device)
        positions = torch.cat([torch.arange(w.start, w.start + len(w.token_ids)) for w in mb])
        last = torch.tensor([len(w.token_ids) for w in mb]).cumsum(0) - 1
        return cls(mb, to_device(positions, device), embed_tokens(embed, tokens), to_device(last, device))


def check_micro_batch(mb: list[SequenceWork], samplers: dict) -> None:
    """The errors a micro-batch can have, before anything of it runs."""
    if not mb:
        raise ServiceError("a micro-batch is empty", grpc.StatusCode.INVALID_ARGUMENT)
    for w in mb:
        if w.sampling is None and w.seq_id not in samplers:
            raise ServiceError(
                f"sequence {w.seq_id} is unknown here: its first step must carry sampling parameters",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if not w.token_ids:
            raise ServiceError(f"sequence {w.seq_id} has no new tokens", grpc.StatusCode.INVALID_ARGUMENT)


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor onto the device without blocking the host (pinned, then async)."""
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values
