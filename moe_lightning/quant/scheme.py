"""How expert weights are stored: the model's own dtype, int8, int4 or mxfp4 (docs/quantization.md).

Formats, with N output features, K input features and G the int4 group size:

    int8  qweight int8 (N, K), scales float32 (N,): w = q * scale (per output channel, symmetric)
    int4  qweight uint8 (N, K/2), two values per byte, column 2j in the high nibble (the packing
          PyTorch's int4 kernels take); scales and zeros float32 (N, K/G): w = (q - 8) * scale + zero
          (the zero in the weights' domain, as those kernels want it); perm int32 (P, K) when the
          checkpoint was quantized in activation order (GPTQ desc_act): part p of the rows (gate,
          up) reads its input columns in the order perm[p], so its groups are contiguous again
    mxfp4 qweight uint8 (N, K/2), e2m1 values two per byte, column 2j in the LOW nibble (GPT-OSS's
          `*_blocks` (N, K/32, 16) flattened, no repacking); scales uint8 (N, K/32), e8m0:
          w = e2m1(q) * 2^(scale - 127), one scale per 32 input columns (quant/mxfp4.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class QuantFormat(StrEnum):
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    MXFP4 = "mxfp4"


INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128
MXFP4_BLOCK = 32  # input values per e8m0 scale: fixed by the format (OCP MX)
COMPONENT_ALIGN = 64  # between the parts of one expert's page: a page stays one contiguous transfer
DEQUANT_CHUNK = 1 << 22  # weights dequantize-then-GEMM expands at a time on a CPU: bounds its scratch (~40 MB)
# On CUDA a block is bounded by the bytes of its float32 copy: 256 MiB, 64 Mi weights. A whole linear
# at once was a whole-weight float32 copy and more (DeepSeek-V3's int8 LM head, 129280 x 7168: 7.4 GB
# at start, on GPUs sized for the model). The CPU's 4 M weights would launch-bind the GPU (a Mixtral
# expert w13 was 28 blocks of 4-5 kernels); at 64 Mi that w13 (117 M weights) is 2 blocks and its w2
# (59 M) one, and a block's ~1.4 GB of dequantization traffic (int8 to bf16: 21 bytes a weight,
# hrm/kernels.py) takes ~0.5 ms at an H100's 3 TB/s, against a few us for launching its 5 kernels.
# DeepSeek-V3's head is 14 blocks, GPT-OSS-120B's (201088 x 2880) 9.
DEVICE_FP32_BLOCK_BYTES = 256 << 20
DEVICE_BLOCK_WEIGHTS = DEVICE_FP32_BLOCK_BYTES // 4


def dequant_chunk(device_type: str) -> float:
    """Weights dequantize-then-GEMM (and quantization at start, quant/dense.py) expands at a time on
    this device type: the kernel and the HRM's model of its scratch both read it."""
    return float(DEVICE_BLOCK_WEIGHTS) if device_type == "cuda" else float(DEQUANT_CHUNK)


def block_rows(out_features: int, in_features: int, weights: float) -> int:
    """Output rows of an (out, in) weight that hold at most `weights` weights (at least one row)."""
    if weights >= out_features * in_features:
        return out_features
    return max(1, int(weights) // in_features)


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """The format of the expert pages. `group_size` is int4's (-1: one group per row, as GPTQ's
    group_size -1), and mxfp4's fixed 32 whatever is given (so that every mxfp4 scheme is equal);
    `act_order` adds the input permutation of GPTQ's desc_act checkpoints."""

    format: QuantFormat = QuantFormat.NONE
    group_size: int = DEFAULT_GROUP_SIZE
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.format is QuantFormat.MXFP4 and self.group_size != MXFP4_BLOCK:
            object.__setattr__(self, "group_size", MXFP4_BLOCK)  # frozen: normalized once, here
        if self.format is QuantFormat.INT4 and self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"int4 group size must be positive or -1, got {self.group_size}")
        if self.act_order and self.format is not QuantFormat.INT4:
            raise ValueError("activation order (GPTQ desc_act) exists only for int4 pages")

    @property
    def quantized(self) -> bool:
        return self.format is not QuantFormat.NONE

    def groups(self, in_features: int) -> int:
        if self.format is QuantFormat.MXFP4 and in_features % MXFP4_BLOCK:
            raise ValueError(f"mxfp4 needs an input width that is a multiple of {MXFP4_BLOCK}, got {in_features}")
        g = in_features if self.group_size == -1 else self.group_size
        if in_features % g:
            raise ValueError(f"int4 group size {g} does not divide the input width {in_features}")
        return in_features // g

    def components(self, out_features: int, in_features: int, parts: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(suffix, dtype, shape) of one linear's pages; `parts`: row blocks with their own
        activation order (2 for a fused gate/up)."""
        n, k = out_features, in_features
        if self.format is QuantFormat.INT8:
            return [("qweight", "int8", (n, k)), ("scales", "float32", (n,))]
        if self.format is QuantFormat.INT4:
            if k % 2:
                raise ValueError(f"int4 needs an even input width, got {k}")
            g = self.groups(k)
            out = [("qweight", "uint8", (n, k // 2)), ("scales", "float32", (n, g)), ("zeros", "float32", (n, g))]
            if self.act_order:
                out.append(("perm", "int32", (parts, k)))
            return out
        if self.format is QuantFormat.MXFP4:
            g = self.groups(k)  # checks k
            return [("qweight", "uint8", (n, k // 2)), ("scales", "uint8", (n, g))]
        raise ValueError("an unquantized linear is one page in the model's dtype")

    def bytes_per_weight(self, in_features: int, dtype_bytes: int) -> float:
        """Average bytes one weight takes in an expert page (scales and zeros included)."""
        if self.format is QuantFormat.INT8:
            return 1 + 4 / in_features
        if self.format is QuantFormat.INT4:
            return 0.5 + 8 * self.groups(in_features) / in_features
        if self.format is QuantFormat.MXFP4:
            return 0.5 + 1 / MXFP4_BLOCK  # 4.25 bits
        return float(dtype_bytes)

    def key(self) -> str:
        """Part of the arena's adoption and converted-copy key."""
        if self.format is QuantFormat.INT4:
            return f"int4-g{self.group_size}{'-act' if self.act_order else ''}"
        return self.format.value


def scheme_of(fmt: QuantFormat, widths: tuple[int, int], groups: tuple[int, int], act_order: bool) -> QuantScheme:
    """The scheme an expert's pages were made with, from their input widths and group counts (w13's,
    w2's): what a manifest or a page carries. One group per row in both is GPTQ's -1 unless the two
    widths are equal, where -1 and a group of that width are the same thing."""
    if fmt is QuantFormat.NONE:
        return QuantScheme()
    if fmt is QuantFormat.INT8:
        return QuantScheme(QuantFormat.INT8)
    if fmt is QuantFormat.MXFP4:
        return QuantScheme(QuantFormat.MXFP4)
    if groups == (1, 1) and widths[0] != widths[1]:
        return QuantScheme(QuantFormat.INT4, -1, act_order)
    return QuantScheme(QuantFormat.INT4, widths[0] // groups[0], act_order)


def parse_quantize(value: str, group_size: int = DEFAULT_GROUP_SIZE) -> QuantScheme:
    """`--quantize` and `--quantize-group-size` as given on a command line (mxfp4's group is 32
    whatever the size given, as int8 has none)."""
    try:
        fmt = QuantFormat(value)
    except ValueError:
        allowed = ", ".join(f.value for f in QuantFormat)
        raise ValueError(f"--quantize must be one of {allowed}, got {value!r}") from None
    if fmt is QuantFormat.INT4 and group_size not in (*INT4_GROUP_SIZES, -1):
        allowed = ", ".join(str(g) for g in (*INT4_GROUP_SIZES, -1))
        raise ValueError(f"--quantize-group-size must be one of {allowed}, got {group_size}")
    return QuantScheme(fmt, group_size)
