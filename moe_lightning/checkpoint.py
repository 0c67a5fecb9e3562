"""Reading HF safetensors checkpoints (single file or sharded) into our weight layout.

Headers are parsed and checked (safetensors_files.py) before any tensor is mapped, so a truncated or
mislabelled file is reported with its name instead of failing deep inside a later read. A 4-bit GPTQ
checkpoint (quant/gptq.py) loads with its experts kept int4 and every other linear dequantized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.quant.gptq import dequantize_gptq, load_gptq_expert
from moe_lightning.quant.gptq_config import read_gptq_config
from moe_lightning.safetensors_files import SafetensorsFiles
from moe_lightning.spec import ModelSpec
from moe_lightning.weights import ExpertWeights, LayerWeights, ModelWeights


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


def _convert(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


@dataclass(frozen=True, slots=True)
class TopNames:
    """HF names of the tensors outside the decoder layers (released checkpoints and transformers'
    save_pretrained use these)."""

    embed: str
    final_norm: str
    lm_head: str = "lm_head.weight"


MixtralNames = TopNames("model.embed_tokens.weight", "model.norm.weight")  # also OLMoE and Qwen-MoE
DbrxNames = TopNames("transformer.wte.weight", "transformer.norm_f.weight")


def top_names(spec: ModelSpec) -> TopNames:
    return DbrxNames if spec.architecture == "DbrxForCausalLM" else MixtralNames


def load_layer(
    reader: CheckpointReader, spec: ModelSpec, i: int, dtype: torch.dtype, device: torch.device | str
) -> LayerWeights:
    if spec.architecture == "DbrxForCausalLM":
        return _load_dbrx_layer(reader, spec, i, dtype, device)
    d, e = spec.hidden_size, spec.num_experts
    p = f"model.layers.{i}"

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return _convert(reader.get(name, shape), dtype, device)

    q = reader.weight(f"{p}.self_attn.q_proj", (spec.q_size, d))
    k = reader.weight(f"{p}.self_attn.k_proj", (spec.kv_size, d))
    v = reader.weight(f"{p}.self_attn.v_proj", (spec.kv_size, d))
    router = mlp = None
    experts: list[ExpertWeights] = []
    if spec.is_sparse(i):
        experts = _load_experts(reader, spec, p, dtype, device)
        if len(experts) != e:
            raise CheckpointError(f"layer {i}: found {len(experts)} experts, config says {e}")
        router_name = f"{p}.block_sparse_moe.gate"
        if not reader.has_linear(router_name):
            router_name = f"{p}.mlp.gate"
        router = _convert(reader.weight(router_name, (e, d)), dtype, device)
    else:  # a dense layer (Qwen-MoE): one SwiGLU MLP
        mlp = _load_mlp(reader, f"{p}.mlp", d, spec.dense_intermediate_size, dtype, device)
    bias = shared = shared_gate = None
    if spec.qkv_bias:
        bias = torch.cat(
            [
                reader.get(f"{p}.self_attn.q_proj.bias", (spec.q_size,)),
                reader.get(f"{p}.self_attn.k_proj.bias", (spec.kv_size,)),
                reader.get(f"{p}.self_attn.v_proj.bias", (spec.kv_size,)),
            ]
        )
        bias = _convert(bias, dtype, device)
    if spec.shared_expert_size and spec.is_sparse(i):
        shared = _load_mlp(reader, f"{p}.mlp.shared_expert", d, spec.shared_expert_size, dtype, device)
        shared_gate = _convert(reader.weight(f"{p}.mlp.shared_expert_gate", (1, d)), dtype, device)
    q_norm = k_norm = None
    if spec.qk_norm is not None:
        q_size, k_size = spec.qk_norm_shapes()
        q_norm = get(f"{p}.self_attn.q_norm.weight", (q_size,))
        k_norm = get(f"{p}.self_attn.k_norm.weight", (k_size,))
    return LayerWeights(
        attn_norm=get(f"{p}.input_layernorm.weight", (d,)),
        wqkv=_convert(torch.cat([q, k, v], dim=0), dtype, device),
        wo=_convert(reader.weight(f"{p}.self_attn.o_proj", (d, spec.q_size)), dtype, device),
        ffn_norm=get(f"{p}.post_attention_layernorm.weight", (d,)),
        router=router,
        experts=experts,
        q_norm=q_norm,
        k_norm=k_norm,
        wqkv_bias=bias,
        shared=shared,
        shared_gate=shared_gate,
        mlp=mlp,
    )


def _load_mlp(
    reader: CheckpointReader, prefix: str, d: int, inter: int, dtype: torch.dtype, device: torch.device | str
) -> ExpertWeights:
    """A SwiGLU MLP stored as {gate,up,down}_proj (Qwen-MoE's shared expert and dense layers)."""
    w1 = reader.weight(f"{prefix}.gate_proj", (inter, d))
    w3 = reader.weight(f"{prefix}.up_proj", (inter, d))
    w2 = reader.weight(f"{prefix}.down_proj", (d, inter))
    return ExpertWeights(_convert(torch.cat([w1, w3], dim=0), dtype, device), _convert(w2, dtype, device))


def _load_dbrx_layer(
    reader: CheckpointReader, spec: ModelSpec, i: int, dtype: torch.dtype, device: torch.device | str
) -> LayerWeights:
    """DBRX: fused Wqkv (our layout already), LayerNorms without bias, and every expert of a layer in
    three (E * I, D) matrices: w1 (gate), v1 (up) and w2 (down, stored transposed)."""
    d, e, inter = spec.hidden_size, spec.num_experts, spec.intermediate_size
    p = f"transformer.blocks.{i}"
    a = f"{p}.norm_attn_norm"

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return _convert(reader.get(name, shape), dtype, device)

    w1 = reader.get(f"{p}.ffn.experts.mlp.w1", (e * inter, d)).view(e, inter, d)
    v1 = reader.get(f"{p}.ffn.experts.mlp.v1", (e * inter, d)).view(e, inter, d)
    w2 = reader.get(f"{p}.ffn.experts.mlp.w2", (e * inter, d)).view(e, inter, d)
    experts = [
        ExpertWeights(_convert(torch.cat([w1[j], v1[j]], dim=0), dtype, device), _convert(w2[j].T, dtype, device))
        for j in range(e)
    ]
    return LayerWeights(
        attn_norm=get(f"{a}.norm_1.weight", (d,)),
        wqkv=get(f"{a}.attn.Wqkv.weight", (spec.q_size + 2 * spec.kv_size, d)),
        wo=get(f"{a}.attn.out_proj.weight", (d, spec.q_size)),
        ffn_norm=get(f"{a}.norm_2.weight", (d,)),
        router=get(f"{p}.ffn.router.layer.weight", (e, d)),
        experts=experts,
    )


def _load_experts(
    reader: CheckpointReader, spec: ModelSpec, prefix: str, dtype: torch.dtype, device: torch.device | str
) -> list[ExpertWeights]:
    d, inter, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    if fused in reader:  # transformers 5 native layout: (E, 2I, D) and (E, D, I)
        gate_up = reader.get(fused, (e, 2 * inter, d))
        down = reader.get(f"{prefix}.mlp.experts.down_proj", (e, d, inter))
        return [ExpertWeights(_convert(gate_up[j], dtype, device), _convert(down[j], dtype, device)) for j in range(e)]
    experts = []
    for j in range(e):
        q = f"{prefix}.block_sparse_moe.experts.{j}"
        if reader.has_linear(f"{q}.w1"):  # Mixtral's names
            names = (f"{q}.w1", f"{q}.w3", f"{q}.w2")
        else:  # OLMoE / Qwen-MoE: mlp.experts.j.{gate,up,down}_proj
            q = f"{prefix}.mlp.experts.{j}"
            names = (f"{q}.gate_proj", f"{q}.up_proj", f"{q}.down_proj")
        if reader.gptq is not None:  # experts stay int4 on the CPU (expert_ffn computes where they live)
            experts.append(load_gptq_expert(reader, names, d, inter, reader.gptq).to(device))
            continue
        w1 = reader.get(f"{names[0]}.weight", (inter, d))
        w3 = reader.get(f"{names[1]}.weight", (inter, d))
        w2 = reader.get(f"{names[2]}.weight", (d, inter))
        experts.append(ExpertWeights(_convert(torch.cat([w1, w3], dim=0), dtype, device), _convert(w2, dtype, device)))
    return experts


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
    d, v = spec.hidden_size, spec.vocab_size
    names = top_names(spec)
    embed = _convert(reader.get(names.embed, (v, d)), dtype, device)
    head = names.lm_head.removesuffix(".weight")  # GPTQModel may quantize it (its config's lm_head)
    if spec.tie_word_embeddings or not reader.has_linear(head):
        if not spec.tie_word_embeddings:
            reader.entry(names.lm_head)  # raises: untied model without lm_head
        lm_head = embed
    else:
        lm_head = _convert(reader.weight(head, (v, d)), dtype, device)
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
        final_norm=_convert(reader.get(names.final_norm, (d,)), dtype, device),
        lm_head=lm_head,
    )
