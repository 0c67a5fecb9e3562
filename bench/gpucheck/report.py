"""The GPU check's conclusions: the ratios against the issues' targets (decode against decode, as the
HRM predicts them, and end to end against end to end beside them), the HRM's prediction next to what
was measured (and the configuration each is of), and the summary that is printed and stored in the
report the moment the main comparison ends (and again at the end of the run)."""

from __future__ import annotations

from typing import Any

from moe_lightning.config.units import format_size

TARGETS = {"ours_over_overlap_off": 3.0, "ours_over_offload": 10.0}  # issue 5
CONFIG_KEYS = ("step_schedule", "batch", "micro_batch_size", "expert_groups", "prefill_budget")


def _pair(predicted: float | None, measured: float | None) -> dict[str, float | None]:
    ratio = measured / predicted if predicted and measured is not None else None
    return {"predicted": predicted, "measured": measured, "measured_over_predicted": ratio}


def _ours_bench(report: dict[str, Any]) -> dict[str, Any]:
    """bench's numbers for the main comparison: the finished phase's, else what it saved before it was
    stopped (bench writes its JSON after every run)."""
    return report.get("ours_bench") or (report.get("partial") or {}).get("ours") or {}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Ours over each baseline: decode tok/s over decode tok/s (the value the target and the HRM's
    prediction are of) and generated tok/s end to end over the same (beside it)."""
    bench, offload = _ours_bench(report), report.get("offload")
    ours = bench.get("ours")
    out: dict[str, dict[str, Any]] = {}
    for key, other in (("ours_over_overlap_off", bench.get("overlap_off")), ("ours_over_offload", offload)):
        if not (ours and other):
            continue
        value = _ratio(ours["decode_tokens_per_second"], other.get("decode_tokens_per_second"))
        e2e = _ratio(ours["generated_tokens_per_second"], other["generated_tokens_per_second"])
        met = value >= TARGETS[key] if value is not None else None
        out[key] = {"value": value, "end_to_end": e2e, "target": TARGETS[key], "met": met}
    return out


def predicted_vs_measured(report: dict[str, Any]) -> dict[str, Any]:
    """The HRM's numbers (computed before the runs) beside the measured ones. Decode tokens per
    second and per-layer times are what the cost model predicts; a layer's measured time is the
    decode step's, N / (decode tok/s * L), as the model relates them. `configuration`: what the
    prediction is of and what ran (bench's report of the orchestrator's settings in force)."""
    hrm, bench, offload = report.get("hrm"), _ours_bench(report), report.get("offload")
    if not hrm or "model" not in report:
        return {}
    layers = report["model"]["layers"]
    measured = {k: (bench.get(k) or {}).get("decode_tokens_per_second") for k in ("ours", "overlap_off")}
    out: dict[str, Any] = {}
    ran = {k: (bench.get(k) or {}).get("in_force") for k in ("ours", "overlap_off")}
    out["configuration"] = {
        "predicted": hrm.get("config"),
        **{f"ran_{k}": v for k, v in ran.items() if v},
        "same": all(v and {c: v.get(c) for c in CONFIG_KEYS} == hrm.get("config") for v in ran.values() if v)
        if any(ran.values())
        else None,
    }
    for key in ("ours", "overlap_off"):
        tps = measured[key]
        out[f"{key}_decode_tokens_per_second"] = _pair(hrm[key]["decode_tokens_per_second"], tps)
        layer = hrm["batch"] / (tps * layers) if tps else None
        out[f"{key}_layer_seconds"] = _pair(hrm[key]["layer_s"], layer)
    out["ours_over_overlap_off_decode"] = _pair(
        hrm["ratios"]["ours_over_overlap_off"], _ratio(measured["ours"], measured["overlap_off"])
    )
    ours_bytes = (bench.get("ours") or {}).get("expert_bytes_per_step")
    out["expert_bytes_per_step"] = {  # measured: bench's average over every step, prefill included
        **_pair(hrm["expert_bytes_per_step"], ours_bytes),
        "note": "measured over prefill and decode steps; predicted for a decode step",
    }
    if offload:
        out["offload_batch"] = _pair(hrm["offload"]["batch"], offload["batch_size"])
        out["ours_over_offload"] = {
            "predicted_at_least": hrm["ratios"]["ours_over_offload"],  # decode, offload at its bound
            "measured_decode": (report.get("ratios", {}).get("ours_over_offload") or {}).get("value"),
        }
    if "hrm_layer_error" in bench:  # bench's own prediction: the calibrated profile of this machine
        out["bench_calibrated_layer_error"] = bench["hrm_layer_error"]
    return out


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A few lines that say what the run found; the JSON holds the rest."""
    bench, offload, hrm = _ours_bench(report), report.get("offload"), report.get("hrm") or {}
    lines = []
    budget = (report.get("budget") or {}).get("ours")
    if budget:
        lines.append(
            f"budget {budget['human']}: {budget['resident_experts']} of {budget['total_experts']} experts"
            f" resident; ours in {budget['dtype']}"
        )
    if hrm:
        lines.append(
            f"HRM pick ({hrm['profile']}): N={hrm['batch']} in {hrm['micro_batches']} micro-batches of"
            f" {hrm['micro_batch']} (cap {hrm['batch_cap']}); binds: {hrm['binding']}"
        )
    if "dtype_fallback" in report:
        lines.append(f"WARNING: {report['dtype_fallback']}")
    lines.append(f"{'':26} {'tok/s':>9} {'decode':>9} {'predicted decode':>17}")

    def row(label: str, run: dict[str, Any] | None, predicted: str, note: str = "") -> str:
        e2e = f"{run['generated_tokens_per_second']:9.1f}" if run else f"{'-':>9}"
        decode = (run or {}).get("decode_tokens_per_second")
        dec = f"{decode:9.1f}" if decode is not None else f"{'':>9}"
        return f"{label:26} {e2e} {dec} {predicted:>17}  {note}".rstrip()

    def pred(key: str) -> str:
        return f"{hrm[key]['decode_tokens_per_second']:.0f}" if hrm else ""

    ours_note = "" if bench.get("ours") else f"({report.get('ours_error') or 'see phases.ours'})"
    lines.append(row("ours", bench.get("ours"), pred("ours"), ours_note))
    lines.append(row("(b) ours, overlap off", bench.get("overlap_off"), pred("overlap_off")))
    if "transformers" in bench:
        lines.append(row("(a) transformers, CPU fp32", bench["transformers"], ""))
    bound = f"<= {hrm['offload']['decode_tokens_per_second']:.0f}" if hrm else ""
    if offload:
        cap = offload.get("total_memory_bytes")
        note = f"(batch {offload['batch_size']}, {offload['prompts_run']} prompts run"
        note += f", all of it in {format_size(cap)})" if cap else ")"
    else:
        note = "(see phases.offload)"
    lines.append(row("accelerate offload", offload, bound, note))
    pvm = report.get("predicted_vs_measured") or {}
    for name, r in (report.get("ratios") or {}).items():
        value = f"{r['value']:.2f}" if r["value"] is not None else "-"
        line = f"ours / {name.removeprefix('ours_over_')}, decode: {value} (target >= {r['target']:g}: "
        e2e = f"{r['end_to_end']:.2f}" if r["end_to_end"] is not None else "-"
        line += f"{'met' if r['met'] else 'NOT met'}); end to end {e2e}"
        if name == "ours_over_overlap_off" and hrm:
            line += f"; HRM predicted {hrm['ratios']['ours_over_overlap_off']:.2f} (decode)"
        if name == "ours_over_offload" and hrm:
            line += f"; HRM: at least {hrm['ratios']['ours_over_offload']:.1f} (decode)"
        lines.append(line)
    config = pvm.get("configuration") or {}
    if config.get("same") is False:
        lines.append(f"WARNING: the runs' configuration differs from the prediction's: {config}")
    streamed = pvm.get("expert_bytes_per_step")
    if streamed and streamed["measured"] is not None:
        lines.append(
            f"expert bytes per step: predicted {streamed['predicted'] / 1e9:.2f} GB (decode), measured"
            f" {streamed['measured'] / 1e9:.2f} GB (all steps)"
        )
    phases = report.get("phases", {})
    saved = (phases.get("ours") or {}).get("runs_saved") or {}
    if "ours" in saved:
        goal = (report.get("limits") or {}).get("first_measurement_seconds")
        lines.append(
            f"ours' numbers saved {saved['ours']:.0f} s into the script (goal <= {goal} s)"
            + (f", (b)'s at {saved['overlap_off']:.0f} s" if "overlap_off" in saved else "")
        )
    bad = [
        f"{n} {'skipped' if p.get('skipped') else 'interrupted' if p.get('stopped') == 'interrupted' else 'FAILED'}"
        for n, p in phases.items()
        if not p.get("ok") and (p.get("skipped") or "rc" in p or p.get("stopped") or p.get("error"))
    ]
    if bad:
        lines.append("phases not ok: " + ", ".join(bad) + " (see phases in the JSON)")
    return lines
