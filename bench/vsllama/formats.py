"""Which of our expert formats runs against which llama.cpp file type.

Ours quantizes the expert FFNs (`--quantize`), and with `--quantize-dense int8` the attention
projections and the LM head too (the `-qd` formats; router and embeddings stay fp32); llama.cpp's
q8_0 / q4_0 file types quantize every 2-D weight but the router (its quantize gives the LM head q6_K
under q4_0). int4 runs at group 128 (our default for this width) and at group 32, the block size of
q4_0 (32 weights sharing one scale), so the second pair stores the same number of scales per weight."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str  # the row's label and --formats' word
    quantize: str  # our --quantize
    group_size: int | None  # our --quantize-group-size (int4 only)
    gguf: str  # llama.cpp's file type: f32, q8_0, q4_0
    quantize_dense: str = "none"  # our --quantize-dense

    @property
    def label(self) -> str:
        return f"{self.name} / {self.gguf}"


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp32", "none", None, "f32"),
        Format("int8", "int8", None, "q8_0"),
        Format("int4", "int4", 128, "q4_0"),
        Format("int4-g32", "int4", 32, "q4_0"),
        Format("int8-qd", "int8", None, "q8_0", "int8"),
        Format("int4-qd", "int4", 128, "q4_0", "int8"),
    )
}


def parse_formats(text: str) -> list[Format]:
    """`fp32,int8` -> those formats, in that order; an unknown name is an error that lists the known ones."""
    names = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise ValueError(f"unknown format(s) {unknown or text!r}; choose among {', '.join(FORMATS)}")
    return [FORMATS[n] for n in names]
