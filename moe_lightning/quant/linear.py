"""A quantized linear layer's tensors (the format is in scheme.py) and y = x @ W^T over them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_lightning.quant.scheme import QuantFormat


@dataclass(slots=True, eq=False)
class QuantizedLinear:
    format: QuantFormat
    qweight: torch.Tensor  # int8 (N, K) | uint8 (N, K/2)
    scales: torch.Tensor  # float32 (N,) | (N, K/G)
    zeros: torch.Tensor | None = None  # float32 (N, K/G) (int4)
    perm: torch.Tensor | None = None  # int32 (P, K): input order of each of P row blocks (act order)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.format is QuantFormat.INT4 else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1] if self.scales.dim() == 2 else self.in_features

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def components(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "qweight", self.qweight
        yield "scales", self.scales
        if self.zeros is not None:
            yield "zeros", self.zeros
        if self.perm is not None:
            yield "perm", self.perm

    def tensors(self) -> Iterator[torch.Tensor]:
        for _, t in self.components():
            yield t

    def rows(self, start: int, stop: int) -> QuantizedLinear:
        """Output rows [start, stop) as views (no perm: the caller applies it)."""
        return QuantizedLinear(
            self.format,
            self.qweight[start:stop],
            self.scales[start:stop],
            None if self.zeros is None else self.zeros[start:stop],
        )

    def to(self, device: torch.device | str) -> QuantizedLinear:
        moved = {name: t.to(device) for name, t in self.components()}
        return QuantizedLinear(self.format, **moved)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight it stands for, columns in the model's order."""
        from moe_lightning.quant.kernels import dequantize

        return dequantize(self, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, K) -> (M, N) in x's dtype, by the kernel chosen for this shape (kernels.py)."""
        from moe_lightning.quant.kernels import quantized_linear

        return quantized_linear(x, self)
