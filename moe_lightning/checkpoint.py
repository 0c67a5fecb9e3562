"""Reading HF safetensors checkpoints (single file or sharded) into our weight layout, each family's
layers by its own loader (moe_lightning/families/).

Headers are parsed and checked (safetensors_files.py) before any tensor is mapped, so a truncated or
mislabelled file is reported with its name instead of failing deep inside a later read. A 4-bit GPTQ
checkpoint (quant/gptq.py) loads with its experts kept int4 and every other linear dequantized.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog
import torch
from tqdm import tqdm

from moe_lightning.families import Family, TopNames, by_architecture
from moe_lightning.families.hf_layout import to_layout
from moe_lightning.quant.gptq import dequantize_gptq
from moe_lightning.quant.gptq_config import read_gptq_config
from moe_lightning.safetensors_files import SafetensorsFiles
from moe_lightning.spec import ModelSpec
from moe_lightning.weights import LayerWeights, ModelWeights


class CheckpointReader(SafetensorsFiles):
    """A model directory's tensors, and its linears' dense weights whether stored so or as GPTQ's."""

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__(model_dir)
        # read up front: a quantization we cannot run fails here, before any layer is converted
        self.gptq = read_gptq_config(self.model_dir)

    def has_linear(self, base: str) -> bool:
        """Whether the linear layer `base` (its name without .weight) is stored, dense or GPTQ."""
        return f"{base}.weight" in self or (self.gptq is not None and f"{base}.qweight" in self)

    def weight(self, base: str, shape: tuple[int, int]) -> torch.Tensor:
        """The dense weight of the linear `base`: as stored, or dequantized when GPTQ quantized it."""
        if self.gptq is not None and f"{base}.weight" not in self and f"{base}.qweight" in self:
            return dequantize_gptq(self, base, self.gptq, shape)
        return self.get(f"{base}.weight", shape)


_LAYER = re.compile(r"^(?:model\.layers|transformer\.blocks)\.(\d+)\.")


def skip_extra_layers(reader: CheckpointReader, spec: ModelSpec) -> list[int]:
    """Layers the checkpoint holds past the decoder's last (the multi-token-prediction layers DeepSeek-V3
    and GLM-4.5 publish, which generation does not run): none is read, and the log names them."""
    extra = sorted({int(m[1]) for name in reader.entries if (m := _LAYER.match(name)) and int(m[1]) >= spec.num_layers})
    if extra:
        structlog.get_logger().info(
            "checkpoint_layers_skipped",
            layers=extra,
            reason=f"past the decoder's {spec.num_layers} layers (multi-token prediction): not used for generation",
        )
    return extra


def family_of(spec: ModelSpec) -> Family:
    return by_architecture(spec.architecture)


def top_names(spec: ModelSpec) -> TopNames:
    return family_of(spec).top_names


def load_layer(
    reader: CheckpointReader, spec: ModelSpec, i: int, dtype: torch.dtype, device: torch.device | str
) -> LayerWeights:
    """Decoder layer i in our layout, by the family's own loader (its names and layouts)."""
    return family_of(spec).load_layer(reader, spec, i, dtype, device)


def load_model_weights(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
    layers: Iterable[int] | None = None,
    on_layer: Callable[[int], None] | None = None,
) -> ModelWeights:
    """Loads (a subset of) the model into our layout, converting to `dtype` on `device`."""
    reader = CheckpointReader(model_dir)
    skip_extra_layers(reader, spec)
    d, v = spec.hidden_size, spec.vocab_size
    names = top_names(spec)
    embed = to_layout(reader.get(names.embed, (v, d)), dtype, device)
    head = names.lm_head.removesuffix(".weight")  # GPTQModel may quantize it (its config's lm_head)
    if spec.tie_word_embeddings or not reader.has_linear(head):
        if not spec.tie_word_embeddings:
            reader.entry(names.lm_head)  # raises: untied model without lm_head
        lm_head = embed
    else:
        lm_head = to_layout(reader.weight(head, (v, d)), dtype, device)
    wanted = list(range(spec.num_layers)) if layers is None else list(layers)
    loaded = []
    bar = tqdm(wanted, desc="loading layers", unit="layer", disable=not progress, leave=False)
    for i in bar:
        loaded.append(load_layer(reader, spec, i, dtype, device))
        if on_layer is not None:
            on_layer(i)
    return ModelWeights(
        embed=embed,
        layers=loaded,
        final_norm=to_layout(reader.get(names.final_norm, (d,)), dtype, device),
        lm_head=lm_head,
    )
