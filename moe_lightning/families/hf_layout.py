"""The decoder layout most families share: `model.layers.{i}` with `self_attn.{q,k,v,o}_proj`, two
RMSNorms, and an MoE block of a router and experts (per-expert linears as released, or transformers
5's fused `experts.gate_up_proj` / `experts.down_proj`). Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE
differ here only by where the MoE block's tensors are (`MoeNames`) and by ModelSpec fields (q/k
norms, QKV bias, shared expert, dense layers), which this module reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from moe_lightning.checkpoint_error import CheckpointError
from moe_lightning.families.family import HF_TOP_NAMES, MLP_NAMES, MoeNames, Randoms
from moe_lightning.quant.gptq import load_gptq_expert
from moe_lightning.spec import ModelSpec
from moe_lightning.stages.mla import mla_shape, mla_weights_from_hf
from moe_lightning.weights import ExpertWeights, LayerWeights, MlaWeights

if TYPE_CHECKING:
    from moe_lightning.checkpoint import CheckpointReader


# safetensors hands out views of its file mapping, whose tensors start wherever the header left them
# (8-byte aligned); a host GEMM over a weight not on a 64-byte line boundary splits every vector load in
# two (a decode step's down projections 1.5x slower: docs/quantization.md, "Kernels")
CACHE_LINE = 64


def to_layout(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A checkpoint tensor in our dtype, on `device`, contiguous, and on the host cache-line aligned."""
    out = t.to(device=device, dtype=dtype).contiguous()
    if out.device.type == "cpu" and out.data_ptr() % CACHE_LINE and out.numel():
        out = out.clone()  # PyTorch's host allocator aligns to 64 bytes
    return out


def load_layer(
    reader: CheckpointReader,
    spec: ModelSpec,
    i: int,
    dtype: torch.dtype,
    device: torch.device | str,
    moe_names: tuple[MoeNames, ...] = (MLP_NAMES,),
) -> LayerWeights:
    """Decoder layer i; `moe_names`: where the family's MoE block may be, the first found is used."""
    d, e = spec.hidden_size, spec.num_experts
    p = f"model.layers.{i}"

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return to_layout(reader.get(name, shape), dtype, device)

    wqkv = mla = None
    if spec.attention == "mla":
        mla = load_mla(reader, spec, f"{p}.self_attn", dtype, device)
    else:
        q = reader.weight(f"{p}.self_attn.q_proj", (spec.q_size, d))
        k = reader.weight(f"{p}.self_attn.k_proj", (spec.kv_size, d))
        v = reader.weight(f"{p}.self_attn.v_proj", (spec.kv_size, d))
        wqkv = to_layout(torch.cat([q, k, v], dim=0), dtype, device)
    router = mlp = router_bias = None
    names = moe_names[-1]
    experts: list[ExpertWeights] = []
    if spec.is_sparse(i):
        names = next((n for n in moe_names if reader.has_linear(f"{p}.{n.module}.gate")), moe_names[-1])
        experts = load_experts(reader, spec, p, names, dtype, device)
        if len(experts) != e:
            raise CheckpointError(f"layer {i}: found {len(experts)} experts, config says {e}")
        # a sigmoid router and its selection bias stay fp32, as the reference keeps them (arena_layout.py)
        router_dtype = torch.float32 if spec.router_score == "sigmoid" else dtype
        router = to_layout(reader.weight(f"{p}.{names.module}.gate", (e, d)), router_dtype, device)
        if spec.router_score == "sigmoid":
            bias = reader.get(f"{p}.{names.module}.gate.e_score_correction_bias", (e,))
            router_bias = to_layout(bias, torch.float32, device)
    else:  # a dense layer (Qwen-MoE): one SwiGLU MLP
        mlp = load_mlp(reader, f"{p}.mlp", d, spec.dense_intermediate_size, dtype, device)
    bias = shared = shared_gate = None
    if spec.qkv_bias:
        bias = torch.cat(
            [
                reader.get(f"{p}.self_attn.q_proj.bias", (spec.q_size,)),
                reader.get(f"{p}.self_attn.k_proj.bias", (spec.kv_size,)),
                reader.get(f"{p}.self_attn.v_proj.bias", (spec.kv_size,)),
            ]
        )
        bias = to_layout(bias, dtype, device)
    if spec.shared_expert_size and spec.is_sparse(i):
        shared = load_mlp(reader, f"{p}.{names.module}.{names.shared}", d, spec.shared_expert_size, dtype, device)
        if spec.shared_expert_gate:
            shared_gate = to_layout(reader.weight(f"{p}.{names.module}.{names.shared}_gate", (1, d)), dtype, device)
    q_norm = k_norm = None
    if spec.qk_norm is not None:
        q_size, k_size = spec.qk_norm_shapes()
        q_norm = get(f"{p}.self_attn.q_norm.weight", (q_size,))
        k_norm = get(f"{p}.self_attn.k_norm.weight", (k_size,))
    return LayerWeights(
        attn_norm=get(f"{p}.input_layernorm.weight", (d,)),
        wqkv=wqkv,
        wo=to_layout(reader.weight(f"{p}.self_attn.o_proj", (d, spec.o_proj_in)), dtype, device),
        ffn_norm=get(f"{p}.post_attention_layernorm.weight", (d,)),
        router=router,
        experts=experts,
        q_norm=q_norm,
        k_norm=k_norm,
        wqkv_bias=bias,
        shared=shared,
        shared_gate=shared_gate,
        mlp=mlp,
        router_bias=router_bias,
        mla=mla,
    )


def load_mla(
    reader: CheckpointReader, spec: ModelSpec, prefix: str, dtype: torch.dtype, device: torch.device | str
) -> MlaWeights:
    """A layer's MLA projections under `prefix` (its self_attn), kv_b_proj split into w_uk / w_uv."""
    tensors = {}
    for name, shape in mla_checkpoint_shapes(spec):
        t = (
            reader.get(f"{prefix}.{name}", shape)
            if "layernorm" in name
            else reader.weight(f"{prefix}.{name[:-7]}", shape)
        )
        tensors[name] = to_layout(t, dtype, device)
    return mla_weights_from_hf(mla_shape(spec), tensors)


def mla_checkpoint_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Names (under self_attn) and shapes of a layer's MLA tensors in a checkpoint, o_proj aside."""
    d, h, c, r = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    qk = spec.qk_nope_head_dim + r
    if spec.q_lora_rank is None:
        yield "q_proj.weight", (h * qk, d)
    else:
        yield "q_a_proj.weight", (spec.q_lora_rank, d)
        yield "q_a_layernorm.weight", (spec.q_lora_rank,)
        yield "q_b_proj.weight", (h * qk, spec.q_lora_rank)
    yield "kv_a_proj_with_mqa.weight", (c + r, d)
    yield "kv_a_layernorm.weight", (c,)
    yield "kv_b_proj.weight", (h * (spec.qk_nope_head_dim + spec.v_head_dim), c)


def load_mlp(
    reader: CheckpointReader, prefix: str, d: int, inter: int, dtype: torch.dtype, device: torch.device | str
) -> ExpertWeights:
    """A SwiGLU MLP stored as {gate,up,down}_proj (shared experts and dense layers)."""
    w1 = reader.weight(f"{prefix}.gate_proj", (inter, d))
    w3 = reader.weight(f"{prefix}.up_proj", (inter, d))
    w2 = reader.weight(f"{prefix}.down_proj", (d, inter))
    return ExpertWeights(to_layout(torch.cat([w1, w3], dim=0), dtype, device), to_layout(w2, dtype, device))


def load_experts(
    reader: CheckpointReader,
    spec: ModelSpec,
    prefix: str,
    names: MoeNames,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[ExpertWeights]:
    d, inter, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    if fused in reader:  # transformers 5 native layout: (E, 2I, D) and (E, D, I)
        gate_up = reader.get(fused, (e, 2 * inter, d))
        down = reader.get(f"{prefix}.mlp.experts.down_proj", (e, d, inter))
        gate_up, down = to_layout(gate_up, dtype, device), to_layout(down, dtype, device)
        return [ExpertWeights(gate_up[j], down[j]) for j in range(e)]
    experts = []
    for j in range(e):
        q = f"{prefix}.{names.module}.experts.{j}"
        linears = (f"{q}.{names.gate}", f"{q}.{names.up}", f"{q}.{names.down}")
        if reader.gptq is not None:  # experts stay int4 on the CPU (expert_ffn computes where they live)
            experts.append(load_gptq_expert(reader, linears, d, inter, reader.gptq).to(device))
            continue
        w1 = reader.get(f"{linears[0]}.weight", (inter, d))
        w3 = reader.get(f"{linears[1]}.weight", (inter, d))
        w2 = reader.get(f"{linears[2]}.weight", (d, inter))
        w13 = torch.cat([w1, w3], dim=0)
        experts.append(ExpertWeights(to_layout(w13, dtype, device), to_layout(w2, dtype, device)))
    return experts


def random_weights(
    spec: ModelSpec, rand: Randoms, progress: bool, moe: MoeNames = MLP_NAMES
) -> dict[str, torch.Tensor]:
    """A random checkpoint in this layout, per-expert linears under `moe` (as released checkpoints are)."""
    d, inter = spec.hidden_size, spec.intermediate_size
    normal, norm = rand.normal, rand.norm
    sd: dict[str, torch.Tensor] = {HF_TOP_NAMES.embed: normal(spec.vocab_size, d)}
    for i in tqdm(range(spec.num_layers), desc="generating layers", unit="layer", disable=not progress, leave=False):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = norm(d)
        if spec.attention == "mla":
            for name, shape in mla_checkpoint_shapes(spec):
                sd[f"{p}.self_attn.{name}"] = norm(shape[0]) if "layernorm" in name else normal(*shape)
        else:
            sd[f"{p}.self_attn.q_proj.weight"] = normal(spec.q_size, d)
            sd[f"{p}.self_attn.k_proj.weight"] = normal(spec.kv_size, d)
            sd[f"{p}.self_attn.v_proj.weight"] = normal(spec.kv_size, d)
        sd[f"{p}.self_attn.o_proj.weight"] = normal(d, spec.o_proj_in)
        sd[f"{p}.post_attention_layernorm.weight"] = norm(d)
        if spec.qk_norm is not None:
            q_size, k_size = spec.qk_norm_shapes()
            sd[f"{p}.self_attn.q_norm.weight"] = norm(q_size)
            sd[f"{p}.self_attn.k_norm.weight"] = norm(k_size)
        if spec.qkv_bias:
            for proj, size in (("q_proj", spec.q_size), ("k_proj", spec.kv_size), ("v_proj", spec.kv_size)):
                sd[f"{p}.self_attn.{proj}.bias"] = normal(size)
        if not spec.is_sparse(i):  # a dense layer: one MLP
            sd.update(random_mlp(f"{p}.mlp", d, spec.dense_intermediate_size, rand))
            continue
        if spec.shared_expert_size:
            sd.update(random_mlp(f"{p}.{moe.module}.{moe.shared}", d, spec.shared_expert_size, rand))
            if spec.shared_expert_gate:
                sd[f"{p}.{moe.module}.{moe.shared}_gate.weight"] = normal(1, d)
        sd[f"{p}.{moe.module}.gate.weight"] = normal(spec.num_experts, d)
        if spec.router_score == "sigmoid":  # a bias large enough to change some choices
            sd[f"{p}.{moe.module}.gate.e_score_correction_bias"] = rand.normal(spec.num_experts) * 5
        for e in range(spec.num_experts):
            q = f"{p}.{moe.module}.experts.{e}"
            sd[f"{q}.{moe.gate}.weight"] = normal(inter, d)
            sd[f"{q}.{moe.up}.weight"] = normal(inter, d)
            sd[f"{q}.{moe.down}.weight"] = normal(d, inter)
    sd[HF_TOP_NAMES.final_norm] = norm(d)
    if not spec.tie_word_embeddings:
        sd[HF_TOP_NAMES.lm_head] = normal(spec.vocab_size, d)
    return sd


def random_mlp(prefix: str, d: int, inter: int, rand: Randoms) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP's {gate,up,down}_proj under `prefix`."""
    shapes = (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter)))
    return {f"{prefix}.{name}.weight": rand.normal(*shape) for name, shape in shapes}
