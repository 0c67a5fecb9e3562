"""Where attention and the expert FFNs run: one type the HRM chooses, the step plan carries and
the workers read (docs/design.md, "Placement").

`Side` values are the strings operators type (`--attention-placement cpu`) and metrics show, so a
`Side` compares equal to "cpu" / "gpu".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Side(StrEnum):
    HOST = "cpu"  # the host CPU, next to host memory (the KV cache, the weight arena)
    DEVICE = "gpu"  # gpu_expert's device


@dataclass(frozen=True, slots=True)
class Placement:
    attention: Side = Side.HOST  # HOST: cpu_attention over the host KV cache; DEVICE: gpu_expert's own cache
    experts: Side = Side.DEVICE  # DEVICE: non-resident experts streamed in; HOST: computed where they live

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", Side(self.attention))
        object.__setattr__(self, "experts", Side(self.experts))

    @property
    def attention_on_device(self) -> bool:
        return self.attention is Side.DEVICE

    @property
    def experts_on_host(self) -> bool:
        return self.experts is Side.HOST

    def __str__(self) -> str:
        return f"{self.attention}/{self.experts}"
