"""What a model family is, as one value: how its config.json reads into a ModelSpec, where its
checkpoint keeps each tensor, how a random checkpoint of it is written, and the published shapes
`plan --arch` knows it by (docs/architecture.md, "Model families").

The registry is imported by `plan`, the client and the CLI's parser, which start without torch: a
family module keeps its torch work (loading and generating tensors) in functions that import their
helpers when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from moe_lightning.checkpoint import CheckpointReader
    from moe_lightning.spec import ModelSpec
    from moe_lightning.weights import LayerWeights


@dataclass(frozen=True, slots=True)
class TopNames:
    """HF names of the tensors outside the decoder layers (released checkpoints and transformers'
    save_pretrained use these)."""

    embed: str
    final_norm: str
    lm_head: str = "lm_head.weight"


@dataclass(frozen=True, slots=True)
class MoeNames:
    """Where a layer of the shared HF layout (hf_layout.py) keeps its router (`{module}.gate`) and
    per-expert linears (`{module}.experts.{j}.{gate, up, down}`)."""

    module: str
    gate: str
    up: str
    down: str
    shared: str = "shared_expert"  # `{module}.{shared}.{gate,up,down}_proj`: Qwen2-MoE's; "shared_experts": GLM's


HF_TOP_NAMES = TopNames("model.embed_tokens.weight", "model.norm.weight")  # the shared HF layout's
MLP_NAMES = MoeNames("mlp", "gate_proj", "up_proj", "down_proj")  # OLMoE, Qwen-MoE, transformers 5's Mixtral
SHARED_EXPERTS_NAMES = MoeNames("mlp", "gate_proj", "up_proj", "down_proj", "shared_experts")  # GLM-4.5


@dataclass(frozen=True, slots=True)
class Randoms:
    """Seeded random tensors for a demo checkpoint: `normal(*shape)` weights, `norm(size)` norm
    weights (not all ones, so that a test notices a norm weight dropped or misplaced)."""

    normal: Callable[..., torch.Tensor]
    norm: Callable[[int], torch.Tensor]


ReadConfig = Callable[[dict[str, Any], str], dict[str, Any]]  # (config.json, architecture) -> ModelSpec fields
LoadLayer = Callable[["CheckpointReader", "ModelSpec", int, "torch.dtype", "torch.device | str"], "LayerWeights"]
DemoConfig = Callable[[dict[str, Any], str], dict[str, Any]]  # (preset in Mixtral's names, dtype) -> config.json
RandomWeights = Callable[["ModelSpec", Randoms, bool], dict[str, "torch.Tensor"]]  # (spec, randoms, progress)


@dataclass(frozen=True, slots=True)
class Family:
    """One model family. Everything that differs between families lives in its module; the stages
    read the differences as ModelSpec fields that `read_config` sets."""

    name: str  # as users spell it: `make-demo-model --family`
    architecture: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type (a config without architectures names only this)
    read_config: ReadConfig
    load_layer: LoadLayer  # decoder layer i of a checkpoint into our layout (weights.py)
    top_names: TopNames
    demo_config: DemoConfig
    random_weights: RandomWeights  # a checkpoint's state dict under the family's own names
    plan_presets: Mapping[str, ModelSpec]  # published shapes, for planning without a checkpoint
    gptq_unsupported: str | None = None  # why a GPTQ checkpoint of this family cannot load; None: it can
    # the experts' format as the family publishes them ("mxfp4": GPT-OSS): `plan --arch` plans it by default
    published_experts: str = "none"
    # its demo checkpoint's chat format: the template (None: the generic ChatML-like one), the special
    # tokens it writes (added to the demo tokenizer) and those that end a generation (its EOS ids)
    chat_template: str | None = None
    special_tokens: tuple[str, ...] = ()
    stop_tokens: tuple[str, ...] = ()


def hf_layout_family(moe_names: tuple[MoeNames, ...] = (MLP_NAMES,)) -> tuple[LoadLayer, RandomWeights]:
    """`load_layer` and `random_weights` of the shared HF layout (hf_layout.py), its MoE block at the
    first of `moe_names` found (a demo checkpoint writes the first)."""

    def load_layer(
        reader: CheckpointReader, spec: ModelSpec, i: int, dtype: torch.dtype, device: torch.device | str
    ) -> LayerWeights:
        from moe_lightning.families import hf_layout

        return hf_layout.load_layer(reader, spec, i, dtype, device, moe_names)

    def random_weights(spec: ModelSpec, rand: Randoms, progress: bool) -> dict[str, torch.Tensor]:
        from moe_lightning.families import hf_layout

        return hf_layout.random_weights(spec, rand, progress, moe_names[0])

    return load_layer, random_weights
