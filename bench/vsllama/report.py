"""One pair's figures (ours and llama.cpp on the same format, batch and prompts), the table of all pairs
with ratios and roof shares, and the issue's goals checked against them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# issue 34, item 4: ours' decode against llama.cpp's, by batch; and ours' decode against the compute roof
RATIO_GOALS = {64: 1.5, 256: 2.0}
ROOF_GOAL = (64, 0.5)


def llama_rates(result: dict[str, Any], prompts: int, gen_len: int) -> dict[str, float]:
    """tok/s of a llama_worker run, counted as ours are: every generated token end to end (its
    prefill and decode phases), and the N x (gen_len - 1) tokens of the decode steps over their time."""
    total = result["prefill_seconds"] + result["decode_seconds"]
    return {
        "e2e_tokens_per_second": prompts * gen_len / total,
        "decode_tokens_per_second": prompts * (gen_len - 1) / result["decode_seconds"],
    }


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """How often the two greedy generations agree: the first token (from the prefill) and whole
    sequences. Not a goal (int8 and q8_0 round differently, and random weights give near-ties), but
    f32 against fp32 agreeing on most first tokens says both ran the same model."""
    n = len(ours)
    return {
        "first_token": sum(a[:1] == b[:1] for a, b in zip(ours, theirs, strict=True)) / n,
        "whole_sequence": sum(a == b for a, b in zip(ours, theirs, strict=True)) / n,
    }


def make_pair(
    fmt: Any, prompts: int, gen_len: int, roof: float, ours: dict[str, Any], llama: dict[str, Any]
) -> dict[str, Any]:
    """The JSON record of one pair; token ids are compared, then dropped."""
    ours_ids, llama_ids = ours.pop("token_ids"), llama.pop("token_ids")
    llama = {**llama, **llama_rates(llama, prompts, gen_len)}
    od, ld = ours["decode_tokens_per_second"], llama["decode_tokens_per_second"]
    pair = {
        "format": fmt.name,
        "gguf": fmt.gguf,
        "group_size": fmt.group_size,
        "quantize_dense": fmt.quantize_dense,
        "prompts": prompts,
        "gen_len": gen_len,
        "ours": ours,
        "llama_cpp": llama,
        "decode_ratio": od / ld if ld else 0.0,
        "e2e_ratio": ours["e2e_tokens_per_second"] / llama["e2e_tokens_per_second"],
        "agreement": agreement(ours_ids, llama_ids),
    }
    apply_roof(pair, roof)
    return pair


def apply_roof(pair: dict[str, Any], roof: float) -> None:
    """Each decode as a share of the roof (tok/s), which the run may re-measure after its pairs."""
    pair["roof_tokens_per_second"] = roof
    pair["ours_roof_share"] = pair["ours"]["decode_tokens_per_second"] / roof
    pair["llama_roof_share"] = pair["llama_cpp"]["decode_tokens_per_second"] / roof


@dataclass
class Goal:
    what: str
    value: float
    target: float

    @property
    def met(self) -> bool:
        return self.value >= self.target

    def line(self) -> str:
        return f"{self.what}: {self.value:.2f} (goal >= {self.target}) {'met' if self.met else 'NOT met'}"


def goals(pairs: list[dict[str, Any]]) -> list[Goal]:
    """Every goal the pairs measured: the decode ratio at 64 and 256 prompts, each format; the roof
    share at 64."""
    out = []
    for p in pairs:
        label = f"{p['format']} vs {p['gguf']}, {p['prompts']} prompts"
        if p["prompts"] in RATIO_GOALS:
            out.append(Goal(f"decode ours / llama.cpp, {label}", p["decode_ratio"], RATIO_GOALS[p["prompts"]]))
        if p["prompts"] == ROOF_GOAL[0]:
            out.append(Goal(f"decode ours / compute roof, {label}", p["ours_roof_share"], ROOF_GOAL[1]))
    return out


COLUMNS = (
    ("format", 18),
    ("N", 4),
    ("ours e2e", 9),
    ("ours dec", 9),
    ("llama e2e", 10),
    ("llama dec", 10),
    ("dec ratio", 10),
    ("e2e ratio", 10),
    ("ours/roof", 10),
    ("llama/roof", 10),
)


def table(pairs: list[dict[str, Any]]) -> list[str]:
    """The table's lines: tok/s end to end and in decode for both, their ratios (ours / llama.cpp),
    each decode as a share of the roof measured in the pair's own run."""
    lines = [_row([name for name, _ in COLUMNS])]
    for p in sorted(pairs, key=lambda p: (p["prompts"], list_order(p["format"]))):
        o, ll = p["ours"], p["llama_cpp"]
        cells = [
            f"{p['format']} / {p['gguf']}",
            str(p["prompts"]),
            f"{o['e2e_tokens_per_second']:.1f}",
            f"{o['decode_tokens_per_second']:.1f}",
            f"{ll['e2e_tokens_per_second']:.1f}",
            f"{ll['decode_tokens_per_second']:.1f}{'' if ll.get('extra_bufts', True) else '*'}",
            f"{p['decode_ratio']:.2f}x",
            f"{p['e2e_ratio']:.2f}x",
            f"{p['ours_roof_share']:.2f}",
            f"{p['llama_roof_share']:.2f}",
        ]
        lines.append(_row(cells))
    return lines


def _row(cells: list[str]) -> str:
    """The first cell left-aligned, the numbers right-aligned, in COLUMNS' widths."""
    widths = [w for _, w in COLUMNS]
    return " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def list_order(name: str) -> int:
    from bench.vsllama.formats import FORMATS

    return list(FORMATS).index(name) if name in FORMATS else len(FORMATS)


def breakdown_lines(pairs: list[dict[str, Any]]) -> list[str]:
    """Where a decode step's time went, ours (gpu_expert's stages, cpu_attention, the control plane)
    beside llama.cpp's (inside llama_decode vs the loop around it), ms per step."""
    out = []
    for p in sorted(pairs, key=lambda p: (p["prompts"], list_order(p["format"]))):
        b, ll = p["ours"]["decode_ms_per_step"], p["llama_cpp"]
        steps = p["gen_len"] - 1
        if not b:
            continue
        stages = ", ".join(
            f"{k} {b[k]:.1f}"
            for k in ("pre_attention", "post_attention", "head", "attention_wait", "cpu_attention")
            if k in b
        )
        out.append(
            f"{p['format']:>8} N={p['prompts']:<4} ours {b['orchestrator_wall']:.1f} ms/step "
            f"(gpu_expert step {b.get('step', 0.0):.1f}: {stages}; control plane {b['control_plane']:.1f}) | "
            f"llama.cpp {ll['decode_seconds'] * 1e3 / steps:.1f} ms/step "
            f"(llama_decode + argmax {ll['decode_call_seconds'] * 1e3 / steps:.1f})"
        )
    return out


def plain_weights_note(pairs: list[dict[str, Any]]) -> list[str]:
    """The footnote of the table's starred llama.cpp figures: runs without its extra buffer types."""
    plain = [p for p in pairs if not p["llama_cpp"].get("extra_bufts", True)]
    if not plain:
        return []
    why = "; ".join(
        f"{p['format']} N={p['prompts']}: {p['llama_cpp'].get('extra_bufts_fallback', 'asked for')}" for p in plain
    )
    return [f"* llama.cpp with its weights as the file has them (no repacking for this CPU, no AMX): {why}"]


def render(pairs: list[dict[str, Any]], roofs: list[dict[str, Any]]) -> str:
    """The whole report: the roof(s), the table, the time per decode step, the goals."""
    lines = []
    for r in roofs:
        runs = r.get("gemm_gflops_runs", [])
        best = f" (the better of the run's start and end: {' and '.join(f'{g:.0f}' for g in runs)})" if runs else ""
        run = f" of the run of {r['run']}" if r.get("run") else ""
        lines.append(
            f"compute roof{run}: {r['gemm_gflops']:.0f} GFLOP/s{best} "
            f"({r['gemm_size']}^3 fp32 GEMM, {r['threads']} threads) / "
            f"(2 x {sum(r['active_parameters'].values()) / 1e6:.1f} M active parameters a token) "
            f"= {r['tokens_per_second']:.0f} tok/s"
        )
    lines += ["", *table(pairs), *plain_weights_note(pairs), "", "decode step, ms:", *breakdown_lines(pairs), ""]
    agree = [
        f"{p['format']} N={p['prompts']}: first token {p['agreement']['first_token']:.0%}, "
        f"whole sequence {p['agreement']['whole_sequence']:.0%}"
        for p in pairs
    ]
    lines += ["greedy agreement with llama.cpp: " + "; ".join(agree), ""]
    checked = goals(pairs)
    lines += ["goals:", *(f"  {g.line()}" for g in checked)] if checked else ["goals: none measured at these sizes"]
    return "\n".join(lines)
