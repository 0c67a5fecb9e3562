"""Start-up refusals that depend only on the config, the checkpoint's config.json and the sizes.

Each is one function, called by the launcher before it spawns anything (`check_stack`: `up` answers
in under a second) and again by the service that would fail on it, so both say the same thing.
Torch-free: `up` must not pay torch's import to refuse a bad flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moe_lightning.config.choices import INT4_GROUP_SIZES, PER_ROW_GROUP
from moe_lightning.config.units import DeviceShare, format_size
from moe_lightning.quant.scheme import MXFP4_BLOCK, QuantFormat, QuantScheme

if TYPE_CHECKING:
    from moe_lightning.arena_layout import ArenaLayout
    from moe_lightning.config.stack import StackConfig
    from moe_lightning.spec import ModelSpec


class TensorParallelError(ValueError):
    """The model cannot be split over the ranks asked for; the message names the numbers."""


class DeviceBudgetError(ValueError):
    """The budget cannot hold what must be on the device; raised at start, never mid-run."""


def expert_input_widths(spec: ModelSpec, world: int = 1) -> dict[str, int]:
    """The input widths of the routed experts' GEMMs on one rank: what an int4 group must divide."""
    return {
        "hidden size (w13's input)": spec.hidden_size,
        "expert intermediate size (w2's input)": spec.intermediate_size // world,
    }


def int4_group_size(spec: ModelSpec, world: int = 1) -> int:
    """The largest of 128, 64, 32 that divides every expert input width (of a rank's slice)."""
    widths = expert_input_widths(spec, world)
    for g in INT4_GROUP_SIZES:
        if all(w % g == 0 for w in widths.values()):
            return g
    named = ", ".join(f"{what} {w}" for what, w in widths.items())
    raise ValueError(
        f"no int4 group size of {', '.join(map(str, INT4_GROUP_SIZES))} divides every expert width ({named}): "
        f"give --quantize-group-size {PER_ROW_GROUP} (one group per row)"
    )


# a group size given for pages whose format fixes it (silently ignoring it would mislead)
_MXFP4_GROUPS = (
    f"mxfp4 has one scale per {MXFP4_BLOCK} weights (its format's block): --quantize-group-size must be "
    f"{MXFP4_BLOCK} or left out, got {{}}"
)


def compared_group_size(quantize: str, group_size: int | None) -> int | None:
    """--quantize-group-size under --compare-quantize: int4's, so the other formats (mxfp4's block is its
    own, int8 and none have none) are compared at theirs rather than refused."""
    return group_size if quantize == "int4" else None


def resolve_group_size(spec: ModelSpec, quantize: str, group_size: int | None, world: int = 1) -> int:
    """--quantize-group-size as the weight store uses it: given, or int4's default for these widths."""
    if quantize == "mxfp4" and group_size not in (None, MXFP4_BLOCK):
        raise ValueError(_MXFP4_GROUPS.format(group_size))
    if group_size is not None:
        return group_size
    return int4_group_size(spec, world) if quantize == "int4" else INT4_GROUP_SIZES[0]


def resolve_expert_scheme(
    spec: ModelSpec, model_dir: Path | None, quantize: str, group_size: int | None, world: int = 1
) -> QuantScheme:
    """The expert pages' format every command and service runs for --quantize: auto is the
    checkpoint's own (a GPTQ checkpoint's int4, an MXFP4 one's mxfp4, else none; a model known only by
    name: its family's published format, none but for GPT-OSS's mxfp4), a GPTQ
    checkpoint keeps its own groups, and an int4 group size left out is int4_group_size's."""
    from moe_lightning.quant.gptq_config import read_gptq_config
    from moe_lightning.quant.resolve import resolve_scheme
    from moe_lightning.quant.scheme import parse_quantize

    if model_dir is None:  # a model known by name: auto is its family's published format
        from moe_lightning.families import by_architecture

        if quantize == "auto":
            quantize = by_architecture(spec.architecture).published_experts
        return parse_quantize(quantize, resolve_group_size(spec, quantize, group_size, world))
    if read_gptq_config(model_dir) is not None:  # its own format and groups (or a refusal of another)
        scheme = resolve_scheme(model_dir, quantize, group_size or INT4_GROUP_SIZES[0])
    else:
        scheme = resolve_scheme(model_dir, quantize, resolve_group_size(spec, quantize, group_size, world))
    if scheme.format is QuantFormat.MXFP4 and group_size not in (None, MXFP4_BLOCK):  # (auto: the checkpoint's)
        raise ValueError(_MXFP4_GROUPS.format(group_size))
    return scheme


def check_splittable(spec: ModelSpec, world: int, scheme: QuantScheme | None = None) -> None:
    """Raises TensorParallelError, naming the numbers, if the model cannot be split over `world` ranks."""
    if world == 1:
        return
    problems = []
    h, k = spec.num_heads, spec.num_kv_heads
    if h % world:
        problems.append(f"{h} attention heads do not divide by {world} ranks")
    if k % world if k >= world else world % k:
        problems.append(f"{k} KV heads neither divide by {world} ranks nor divide them (for replication)")
    widths = {"expert intermediate size": spec.intermediate_size}
    if spec.shared_expert_size:
        widths["shared expert intermediate size"] = spec.shared_expert_size
    if spec.dense_layers:
        widths["dense MLP intermediate size"] = spec.dense_intermediate_size
    for what, width in widths.items():
        if width % world:
            problems.append(f"the {what} {width} does not divide by {world} ranks")
    if spec.qk_norm == "full":
        problems.append("its q/k norm spans all heads (OLMoE), which would need a collective per layer")
    if spec.attention == "mla":
        problems.append("its MLA attention is not split over ranks yet (one latent row is shared by every head)")
    if spec.expert_bias or spec.attention_sinks:
        problems.append("its expert biases and attention sinks (GPT-OSS) are not split over ranks yet")
    if scheme is not None and scheme.quantized and not problems:
        cols = spec.intermediate_size // world  # w2's input width on a rank
        if scheme.act_order:
            problems.append("act-order (desc_act) GPTQ experts permute w2's inputs across the ranks' slices")
        elif scheme.format is QuantFormat.INT4 and scheme.group_size != -1 and cols % scheme.group_size:
            problems.append(f"w2's {cols} input columns per rank are not whole int4 groups of {scheme.group_size}")
        elif scheme.format is QuantFormat.INT4 and cols % 2:
            problems.append(f"w2's {cols} input columns per rank do not pack into whole int4 bytes")
        elif scheme.format is QuantFormat.MXFP4 and cols % MXFP4_BLOCK:
            problems.append(f"w2's {cols} input columns per rank are not whole mxfp4 blocks of {MXFP4_BLOCK}")
    if problems:
        raise TensorParallelError(f"the model cannot be split over {world} ranks: " + "; ".join(problems))


def check_dense_fits(weight_budget: int, dense_bytes: int) -> None:
    """What must be on the device whatever the placement: the dense weights (and the head)."""
    if weight_budget < dense_bytes:
        raise DeviceBudgetError(
            f"--device-memory {format_size(weight_budget)} cannot hold the dense weights ({format_size(dense_bytes)})"
        )


def dense_and_expert_bytes(layout: ArenaLayout, spec: ModelSpec) -> tuple[int, int]:
    """(dense bytes, one streamed expert's bytes) of an unsplit arena layout."""
    first = spec.experts_per_layer.index(spec.num_experts)  # the first sparse layer
    expert = layout.expert_page_bytes(first, 0)
    return layout.total_bytes - spec.total_experts * expert, expert


def share_budget(share: DeviceShare, dense_bytes: int, expert_bytes: int, total_experts: int) -> int:
    """`--device-memory 25%`: the dense weights plus that share of the expert pages."""
    return int(dense_bytes + total_experts * expert_bytes * share.fraction)


def link_flag_error(device: str | None, link_bandwidth: float | None) -> str | None:
    """Why --link-bandwidth cannot be used with `device` (None: it can)."""
    if link_bandwidth is None or (device or "cpu").split(":")[0] == "cpu":
        return None
    return (
        f"--link-bandwidth simulates a host-device link for --device cpu; --device {device} copies over its real "
        "link, which is not capped: leave --link-bandwidth out"
    )


def check_device_flags(device: str | None, link_bandwidth: float | None, tp_same_device: bool, tp_backend: str) -> None:
    if error := link_flag_error(device, link_bandwidth):
        raise ValueError(error)
    if tp_same_device and tp_backend != "gloo" and (device or "").startswith("cuda"):
        raise ValueError("--tp-same-device needs --tp-backend gloo: NCCL refuses two ranks on one device")


def check_attention_placement(attention_placement: str, device_kv_memory: int) -> None:
    """`--attention-placement gpu` needs a KV cache on the device to attend over."""
    if attention_placement == "gpu" and device_kv_memory <= 0:
        raise ValueError(
            "placement 'gpu' is not available: gpu_expert has no device KV cache (--device-kv-memory); available: cpu"
        )


@dataclass(frozen=True)
class StackCheck:
    """What check_stack resolved on the way (so the launcher need not resolve it again)."""

    weight_dtype: str
    quantize_group_size: int | None  # None: not int4 (or the checkpoint's own)
    notes: tuple[str, ...]


def check_stack(stack: StackConfig) -> StackCheck:
    """Every refusal of item 2 of docs/configuration.md for this stack, before anything starts: the
    checkpoint's config, the expert format (GPTQ, group size vs widths), the ranks vs the widths, the
    device flags, the budget vs the dense weights and the attention placement. Raises ValueError
    (ModelSpecError, CheckpointError, TensorParallelError, DeviceBudgetError) with the service's words."""
    from moe_lightning.arena_layout import ArenaLayout
    from moe_lightning.quant.gptq_config import read_gptq_config
    from moe_lightning.spec import ModelSpec, resolve_dtype
    from moe_lightning.spec_bounds import check_checkpoint_holds

    notes = []
    spec = ModelSpec.from_pretrained(stack.model)
    check_checkpoint_holds(spec, stack.model)  # before a layout of its pages is built
    dtype = resolve_dtype(stack.dtype, spec.dtype, stack.device)
    scheme = resolve_expert_scheme(spec, stack.model, stack.quantize, stack.quantize_group_size, stack.gpus)
    defaulted = stack.quantize == "int4" and stack.quantize_group_size is None and not scheme.act_order
    group_size = None
    if defaulted and read_gptq_config(stack.model) is None:
        group_size = scheme.group_size
        notes.append(f"--quantize int4: group size {group_size}, the largest of 128, 64, 32 that divides every width")
    check_splittable(spec, stack.gpus, scheme)
    layout = ArenaLayout.for_spec(spec, dtype, scheme)  # a group size that does not divide a width fails here
    check_device_flags(stack.device, stack.link_bandwidth, False, "auto")
    device_kv = stack.device_kv_memory or 0
    if stack.gpus == 1 and stack.device_memory is not None:
        dense, expert = dense_and_expert_bytes(layout, spec)
        budget = stack.device_memory
        if isinstance(budget, DeviceShare):
            budget = share_budget(budget, dense, expert, spec.total_experts) + device_kv
        check_dense_fits(budget - device_kv, dense)
    check_attention_placement(stack.attention_placement, device_kv)
    return StackCheck(dtype, group_size, tuple(notes))
