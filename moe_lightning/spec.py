"""ModelSpec: one normalized, validated description of an MoE decoder.

Every process (weight store, expert runner, attention, orchestrator) works from this object, never
from a raw HF config (moe_lightning/families/ reads those, one reader per family), so the differences
between model families live in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from moe_lightning.config.choices import DTYPE_CHOICES, DTYPE_NAMES
from moe_lightning.hf_configs import ModelSpecError, read_hf_config
from moe_lightning.spec_bounds import check_spec
from moe_lightning.yarn import YarnScaling


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str) -> str:
    """The weights' dtype for `--dtype auto`: on an accelerator the checkpoint's own 16-bit dtype
    (bfloat16 for a checkpoint saved in float32: fp32 would stream twice the bytes); on a CPU
    float32, since bf16/fp16 matmuls are emulated (and slow) on most CPUs."""
    if requested != "auto":
        if requested not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
        return requested
    if device.split(":")[0] == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"


NORMS = ("rms", "layer")  # RMSNorm, or LayerNorm without bias (DBRX)
ATTENTIONS = ("gqa", "mla")  # grouped-query attention; multi-head latent attention (DeepSeek-V3, docs/mla.md)
# softmax over the experts; sigmoid with a selection bias (DeepSeek-V3, GLM-4.5); softmax over the top-k
# logits only, of a router with a bias (GPT-OSS)
ROUTER_SCORES = ("softmax", "sigmoid", "softmax_topk")
# SwiGLU, silu(gate) * up; GPT-OSS's clamped one, (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit
ACTIVATIONS = ("swiglu", "clamped_swiglu")
QK_NORMS = (None, "full", "head")  # RMSNorm of q and k: none, over the whole projection (OLMoE), per head (Qwen3)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes and numerics of an MoE decoder.

    Dimension legend used in shape comments across the code base:
      T tokens in a (ragged) batch, B sequences, D hidden, H query heads, K KV heads, Hd head dim,
      E experts, A active experts per token (top-k), I expert intermediate, V vocab, L layers.
    """

    architecture: str
    hidden_size: int  # D
    intermediate_size: int  # I, one expert's FFN width
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # Hd
    num_experts: int  # E
    top_k: int  # A
    vocab_size: int  # V
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"  # the checkpoint's dtype
    max_position_embeddings: int = 32768
    sliding_window: int | None = None
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))
    # family differences, as data (the stage functions read them)
    qk_norm: str | None = None  # see QK_NORMS
    clip_qkv: float | None = None  # clamp q, k, v to [-c, c] after the projections (OLMoE, DBRX)
    norm: str = "rms"  # the decoder's norms (see NORMS); q/k norms are always RMSNorm
    topk_norm_p: float = 1.0  # with norm_topk_prob: divide the top-k weights by their L_p norm (DBRX's p)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE)
    shared_expert_size: int = 0  # intermediate width of an always-on shared expert; 0: none
    shared_expert_gate: bool = True  # the shared expert scaled by a sigmoid gate (Qwen2-MoE), or added as is
    dense_layers: tuple[int, ...] = ()  # layers whose FFN is one dense SwiGLU MLP, no router (Qwen-MoE)
    dense_intermediate_size: int = 0  # Id, that MLP's width
    # routing (see ROUTER_SCORES): with "sigmoid", experts are chosen by score + a per-expert correction bias
    # among the best `topk_group` of `n_group` expert groups, weighted by their unbiased scores
    router_score: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (after normalising)
    rotary_dim: int | None = None  # the leading head dims RoPE rotates (GLM-4.5: half); None: all of Hd
    rope_interleave: bool = False  # RoPE over interleaved pairs (DeepSeek-V3), not the two halves
    yarn: YarnScaling | None = None
    # MLA (attention "mla", see ATTENTIONS): the cache holds one latent row per token and layer, of
    # C = kv_lora_rank compressed dims and R = qk_rope_head_dim RoPE dims, as one "KV head" (num_kv_heads 1,
    # head_dim C + R); queries are absorbed into that space and values are the row's first C dims
    attention: str = "gqa"
    q_lora_rank: int | None = None  # the query's low-rank bottleneck; None: one q projection
    kv_lora_rank: int = 0  # C
    qk_nope_head_dim: int = 0  # each head's query/key dims without RoPE
    qk_rope_head_dim: int = 0  # R
    v_head_dim: int = 0  # each head's value dims after the value up-projection
    # GPT-OSS
    sliding_layers: tuple[int, ...] | None = None  # the layers `sliding_window` applies to; None: every layer
    attention_sinks: bool = False  # a learned logit per head takes part in each softmax, then is dropped
    o_bias: bool = False  # a bias on o_proj
    expert_bias: bool = False  # biases on the experts' gate/up (2I,) and down (D,) projections
    activation: str = "swiglu"  # see ACTIVATIONS
    swiglu_alpha: float = 1.702  # clamped_swiglu's sigmoid gain
    swiglu_limit: float = 7.0  # clamped_swiglu's clamp

    def __post_init__(self) -> None:
        for f in fields(self):  # a list where a tuple is declared (`ModelSpec(**spec.to_dict())`) is one
            if str(f.type).startswith("tuple[") and isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        check_spec(self)  # types, bounds and finite floats first: the checks below compute with them
        positive = (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "top_k",
            "vocab_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelSpecError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.top_k > self.num_experts:
            raise ModelSpecError(
                f"num_experts_per_tok ({self.top_k}) cannot exceed num_local_experts ({self.num_experts})"
            )
        if self.head_dim % 2:
            raise ModelSpecError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in DTYPE_NAMES:
            raise ModelSpecError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.rope_theta <= 0:
            raise ModelSpecError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ModelSpecError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelSpecError(f"sliding_window must be positive or null, got {self.sliding_window}")
        if self.qk_norm not in QK_NORMS:
            raise ModelSpecError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.norm not in NORMS:
            raise ModelSpecError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.shared_expert_size < 0:
            raise ModelSpecError(f"shared_expert_size must be >= 0, got {self.shared_expert_size!r}")
        if tuple(sorted(set(self.dense_layers))) != tuple(self.dense_layers) or any(
            not 0 <= i < self.num_layers for i in self.dense_layers
        ):
            raise ModelSpecError(
                f"dense_layers must be distinct, sorted layer indices in 0..{self.num_layers - 1}, "
                f"got {list(self.dense_layers)}"
            )
        if self.dense_layers and self.dense_intermediate_size <= 0:
            raise ModelSpecError(
                f"dense layers {list(self.dense_layers)} need a positive intermediate_size, "
                f"got {self.dense_intermediate_size!r}"
            )
        self._check_routing_and_layers()

    def _check_routing_and_layers(self) -> None:
        """The router's, attention's and activation's settings, against each other and the shapes."""
        if self.router_score not in ROUTER_SCORES:
            raise ModelSpecError(f"router_score must be one of {ROUTER_SCORES}, got {self.router_score!r}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ModelSpecError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts}) and topk_group "
                f"({self.topk_group}) be in 1..n_group"
            )
        if self.n_group > 1 and self.router_score != "sigmoid":
            raise ModelSpecError("grouped routing (n_group > 1) is only supported with sigmoid scores")
        if self.n_group > 1 and self.num_experts // self.n_group * self.topk_group < self.top_k:
            raise ModelSpecError(
                f"topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group} experts cannot "
                f"hold num_experts_per_tok ({self.top_k})"
            )
        if not self.routed_scaling_factor > 0:
            raise ModelSpecError(f"routed_scaling_factor must be positive, got {self.routed_scaling_factor!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ModelSpecError(f"rotary_dim must be even and in 1..head_dim ({self.head_dim}), got {self.rotary_dim}")
        if self.attention not in ATTENTIONS:
            raise ModelSpecError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ModelSpecError(f"MLA needs a positive {name}, got {getattr(self, name)!r}")
            if self.num_kv_heads != 1 or self.head_dim != self.kv_lora_rank + self.qk_rope_head_dim:
                raise ModelSpecError(
                    "an MLA spec has one latent KV head of kv_lora_rank + qk_rope_head_dim dims, got "
                    f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
                )
            if self.q_lora_rank is not None and self.q_lora_rank <= 0:
                raise ModelSpecError(f"q_lora_rank must be positive or null, got {self.q_lora_rank!r}")
        if self.sliding_layers is not None:
            if self.sliding_window is None:
                raise ModelSpecError("sliding_layers needs a sliding_window")
            if tuple(sorted(set(self.sliding_layers))) != tuple(self.sliding_layers) or any(
                not 0 <= i < self.num_layers for i in self.sliding_layers
            ):
                raise ModelSpecError(
                    f"sliding_layers must be distinct, sorted layer indices in 0..{self.num_layers - 1}, "
                    f"got {list(self.sliding_layers)}"
                )
        if self.activation not in ACTIVATIONS:
            raise ModelSpecError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.activation == "clamped_swiglu" and not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise ModelSpecError(
                f"swiglu_limit and swiglu_alpha must be positive, got {self.swiglu_limit}, {self.swiglu_alpha}"
            )
        if self.attention_sinks and self.attention == "mla":
            raise ModelSpecError("attention sinks are supported with GQA attention only")
        if not self.topk_norm_p > 0:
            raise ModelSpecError(f"topk_norm_p must be positive, got {self.topk_norm_p!r}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ModelSpecError(f"clip_qkv must be positive or null, got {self.clip_qkv!r}")
        for token_id in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not 0 <= token_id < self.vocab_size:
                raise ModelSpecError(
                    f"special token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
                )

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def o_proj_in(self) -> int:
        """o_proj's input width: the heads' attention outputs, H * Hd (H * v_head_dim with MLA)."""
        return self.num_heads * (self.v_head_dim if self.attention == "mla" else self.head_dim)

    @property
    def kv_tensors(self) -> int:
        """Tensors a KV cache keeps per layer: K and V (2), or MLA's one latent row, whose first C dims
        are also the values (1)."""
        return 1 if self.attention == "mla" else 2

    def window_of(self, layer: int) -> int | None:
        """The sliding window `layer` attends within (None: its whole context)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    def attended_share(self, context: float) -> float:
        """The share of a `context`-token sequence's K/V, over all layers, that decode reads and a cache
        taken by need holds: a sliding layer only its window's (1 without windows). The HRM's figure; the
        cache's, by whole blocks, is KVLayout.held_share."""
        c = max(context, 1.0)
        windows = [self.window_of(i) for i in range(self.num_layers)]
        return sum(1.0 if w is None else min(c, w) / c for w in windows) / self.num_layers

    @property
    def rope_dim(self) -> int:
        """The head dims RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def experts_in(self, layer: int) -> int:
        """Experts of `layer`: E, or 0 for a dense layer."""
        return self.num_experts if self.is_sparse(layer) else 0

    @property
    def experts_per_layer(self) -> tuple[int, ...]:
        return tuple(self.experts_in(i) for i in range(self.num_layers))

    @property
    def num_sparse_layers(self) -> int:
        return self.num_layers - len(self.dense_layers)

    @property
    def total_experts(self) -> int:
        """(layer, expert) pairs: what residency and streaming count over."""
        return self.num_sparse_layers * self.num_experts

    def expert_params(self) -> int:
        """Parameters of one expert (gate, up and down projections, and their biases)."""
        d, i = self.hidden_size, self.intermediate_size
        return 3 * d * i + ((2 * i + d) if self.expert_bias else 0)

    def num_parameters(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        attn = self.attention_params()
        shared = 3 * d * self.shared_expert_size + (d if self.shared_expert_size and self.shared_expert_gate else 0)
        per_layer = attn + 2 * d
        # GPT-OSS's router bias is a parameter; the sigmoid routers' selection bias a buffer (not counted)
        router = self.num_experts * d + (self.num_experts if self.router_score == "softmax_topk" else 0)
        sparse = router + self.num_experts * self.expert_params() + shared
        dense = 3 * d * self.dense_intermediate_size
        head = 0 if self.tie_word_embeddings else v * d
        layers = self.num_layers * per_layer + self.num_sparse_layers * sparse + len(self.dense_layers) * dense
        return v * d + layers + d + head

    def attention_params(self) -> int:
        """Parameters of one layer's attention projections (and their biases and norms)."""
        d = self.hidden_size
        if self.attention == "mla":
            h, c, r = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
            qk = self.qk_nope_head_dim + r
            q = d * h * qk if self.q_lora_rank is None else self.q_lora_rank * (d + 1 + h * qk)
            kv = d * (c + r) + c + h * (self.qk_nope_head_dim + self.v_head_dim) * c
            return q + kv + self.o_proj_in * d
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + sum(self.qk_norm_shapes())
        biases = ((self.q_size + 2 * self.kv_size) if self.qkv_bias else 0) + (d if self.o_bias else 0)
        return attn + biases + (self.num_heads if self.attention_sinks else 0)

    def qk_norm_shapes(self) -> tuple[int, int]:
        """(q norm size, k norm size); (0, 0) without q/k norms."""
        if self.qk_norm == "full":
            return self.q_size, self.kv_size
        if self.qk_norm == "head":
            return self.head_dim, self.head_dim
        return 0, 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["dense_layers"] = list(self.dense_layers)
        if self.sliding_layers is not None:
            out["sliding_layers"] = list(self.sliding_layers)
        return out

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelSpec:
        """The spec `to_dict` (or its JSON) describes."""
        fields = dict(fields)
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
        fields["dense_layers"] = tuple(fields.get("dense_layers", ()))
        if fields.get("sliding_layers") is not None:
            fields["sliding_layers"] = tuple(fields["sliding_layers"])
        if isinstance(fields.get("yarn"), dict):
            fields["yarn"] = YarnScaling(**fields["yarn"])
        return cls(**fields)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        """Builds a spec from the dict of an HF `config.json` by its family's reader; errors name the
        offending field."""
        from moe_lightning.families import spec_fields  # the families' presets are ModelSpecs: imported late

        return cls(**spec_fields(config))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelSpec:
        """The spec of a checkpoint directory. Its EOS ids are config.json's and generation_config.json's
        together, as transformers' generate and vLLM stop on both (GPT-OSS's config names <|return|> only,
        its generation config <|call|> and <|endoftext|> too)."""
        spec = cls.from_hf_config(read_hf_config(model_dir))
        extra = tuple(i for i in generation_eos_ids(model_dir) if i not in spec.eos_token_ids)
        return replace(spec, eos_token_ids=spec.eos_token_ids + extra) if extra else spec


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, () without one (or with one that is not valid JSON: the
    file is optional, and config.json's ids still apply)."""
    import json

    path = Path(model_dir) / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (json.JSONDecodeError, AttributeError, RecursionError):
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return ()
