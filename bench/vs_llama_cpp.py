"""Our stack side by side with llama.cpp, in one run (issue 34, item 4): the same checkpoint (converted
with the converter llama-cpp-python ships), the same prompts (`moe-lightning bench --workload mtbench`'s
token ids), the same number of generated tokens (greedy, EOS ignored) and the same threads, at each
batch size and format: fp32 / int8 / int4 (group 128, and group 32 like q4_0's blocks) against llama.cpp's
f32 / q8_0 / q4_0. Each pair runs back to back (ours, then llama.cpp), pairs one after another; the
compute roof (a 2048^3 fp32 GEMM here, over 2 x the active parameters of a token) is measured in the
same run. Prints one table (tok/s end to end and in decode, ratios, shares of the roof), where a decode
step's time goes, and the goals; --json keeps every figure, written after each pair.

    python bench/vs_llama_cpp.py --model models/demo-bench [--prompts 64,256]
        [--formats fp32,int8,int4,int4-g32,int8-qd,int4-qd] [--gen-len 32] [--threads 2] [--micro-batch-size N]
        [--llama-extra-bufts auto|on|off] [--json OUT]
    python bench/vs_llama_cpp.py --report A.json B.json [--json ALL.json]   # one table of several runs

llama.cpp comes from the optional extra: `pip install -e '.[bench-llama]'` builds llama-cpp-python for
this CPU (many minutes); bench/README.md has the rest.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpucheck.workload import bench_prompts, prompts_digest  # noqa: E402
from bench.vsllama import log  # noqa: E402
from bench.vsllama.formats import FORMATS, Format, parse_formats  # noqa: E402
from bench.vsllama.report import apply_roof, make_pair, render  # noqa: E402
from bench.vsllama.roof import GEMM_SIZE, active_parameters_of, gemm_gflops, roof_tokens_per_second  # noqa: E402

LLAMA_MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids of one context
NO_LLAMA = "llama_cpp does not import: install the optional extra, pip install -e '.[bench-llama]' (bench/README.md)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a Mixtral-style checkpoint directory (make-demo-model --preset bench)")
    p.add_argument("--prompts", default="64,256", help="batch sizes, comma-separated (MT-Bench-shaped prompts)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"pairs to run, of {', '.join(FORMATS)}")
    p.add_argument("--gen-len", type=int, default=32, help="tokens generated per prompt (greedy, EOS ignored)")
    p.add_argument("--threads", type=int, default=2, help="threads of each: llama.cpp's, our workers' torch")
    p.add_argument("--gguf-dir", type=Path, default=None, help="where the GGUF files go (default: MODEL-gguf beside)")
    p.add_argument(
        "--converter",
        type=Path,
        default=None,
        help="a llama.cpp tree with convert_hf_to_gguf.py (default: the installed llama-cpp-python's, from its sdist)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="ours: sequences per micro-batch, 0 the whole batch (default: the HRM's choice)",
    )
    p.add_argument("--kv-unified", action="store_true", help="llama.cpp: one KV buffer (default: one a sequence)")
    p.add_argument(
        "--llama-extra-bufts",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama.cpp's weights repacked for this CPU (AMX tiles where it has AMX): on, off, or auto = on, "
        "and off for a pair whose llama.cpp process a signal kills with them on (a SIGSEGV in its AMX "
        "matmul on some AMX CPUs: bench/README.md)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure here (after each pair)")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="print one table of these --json files")
    args = p.parse_args(argv)
    if args.report is None and args.model is None:
        p.error("--model is needed (or --report)")
    args.prompt_counts = [int(n) for n in args.prompts.split(",") if n.strip()]
    if not all(1 <= n <= LLAMA_MAX_SEQ for n in args.prompt_counts):
        p.error(f"--prompts: 1 to {LLAMA_MAX_SEQ} each (llama.cpp's most sequences in one context), got {args.prompts}")
    try:
        args.format_list = parse_formats(args.formats)
    except ValueError as e:
        p.error(f"--formats: {e}")
    return args


def llama_cpp_problem() -> str:
    """Why llama_cpp does not import ("" when it does), asked of a child process: loading llama.cpp's
    library (and its OpenMP) into this one would share it with the roof's torch GEMM."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True)
    return r.stderr.strip().splitlines()[-1] if r.returncode else ""


def measure_roof(model: Path, threads: int) -> dict[str, Any]:
    params = active_parameters_of(model)
    log("compute roof: a 2048^3 fp32 GEMM...")
    gflops = gemm_gflops(threads)
    log(f"compute roof: {gflops:.0f} GFLOP/s")
    return {
        "gemm_size": GEMM_SIZE,
        "threads": threads,
        "gemm_gflops": gflops,
        "active_parameters": params,
        "tokens_per_second": roof_tokens_per_second(gflops, params),
    }


def run_llama(gguf: Path, prompts: list[list[int]], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """llama.cpp's batched generation in a process of its own (bench/vsllama/llama_worker.py)."""
    src, out = work / "prompts.json", work / "llama.json"
    src.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "bench.vsllama.llama_worker", "generate", str(gguf), str(src), str(out)]
    cmd += ["--gen-len", str(args.gen_len), "--threads", str(args.threads)]
    cmd += ["--kv-unified"] if args.kv_unified else []
    result = run_worker(
        cmd, out, extra_bufts=args.llama_extra_bufts != "off", fallback=args.llama_extra_bufts == "auto"
    )
    log(f"llama.cpp: prefill {result['prefill_seconds']:.1f} s, decode {result['decode_seconds']:.1f} s")
    return result


def run_worker(cmd: list[str], out: Path, extra_bufts: bool, fallback: bool) -> dict[str, Any]:
    """One llama_worker process (its progress bar on our stderr) and the JSON it wrote to `out`. With
    `fallback`, a process killed by a signal while llama.cpp's extra buffer types were on runs once more
    with them off, and the result says so (`extra_bufts_fallback`): llama.cpp's AMX matmul segfaults
    on some AMX CPUs (its issue 20824), which would otherwise end the whole comparison."""
    run = subprocess.run([*cmd, *([] if extra_bufts else ["--no-extra-bufts"])], cwd=REPO)
    if run.returncode < 0 and extra_bufts and fallback:
        name = signal.Signals(-run.returncode).name
        log(f"llama.cpp died of {name} with its extra buffer types (repacked / AMX weights); once more without them")
        result = run_worker(cmd, out, extra_bufts=False, fallback=False)
        result["extra_bufts_fallback"] = f"{name} with them on"
        return result
    if run.returncode:
        raise subprocess.CalledProcessError(run.returncode, run.args)
    return json.loads(out.read_text())


def compare(args: argparse.Namespace) -> dict[str, Any]:
    from bench.vsllama.gguf_files import gguf_files, llama_cpp_version

    model = args.model.resolve()
    config = json.loads((model / "config.json").read_text())
    types = {f.gguf for f in args.format_list}
    files = gguf_files(model, types, args.gguf_dir or model.parent / f"{model.name}-gguf", args.converter, args.threads)
    roof = measure_roof(model, args.threads)
    result: dict[str, Any] = {
        "model": str(model),
        "gen_len": args.gen_len,
        "threads": args.threads,
        "llama_cpp_version": llama_cpp_version(),
        "llama_kv_unified": args.kv_unified,
        "llama_extra_bufts": args.llama_extra_bufts,
        "ours_micro_batch_size": args.micro_batch_size,
        "roofs": [roof],
        "workloads": {},
        "pairs": [],
    }
    total, done = len(args.prompt_counts) * len(args.format_list), 0
    with tempfile.TemporaryDirectory(prefix="vs-llama-cpp-") as tmp:
        for n in args.prompt_counts:
            prompts = bench_prompts(model, config["vocab_size"], n)
            lengths = [len(p) for p in prompts]
            result["workloads"][str(n)] = {
                "average_prompt_tokens": sum(lengths) / n,
                "longest_prompt_tokens": max(lengths),
                "prompts_sha256": prompts_digest(prompts),
            }
            for fmt in args.format_list:
                done += 1
                result["pairs"].append(run_pair(fmt, prompts, files[fmt.gguf], roof, args, Path(tmp), done, total))
                if args.json is not None:
                    args.json.write_text(json.dumps(result, indent=2))
    # again at the end: a 2-second measurement can land on a busy moment of a shared VM, and the roof is
    # what the cores can do, so the better of the two is the run's roof
    end = measure_roof(model, args.threads)
    best = max(roof, end, key=lambda r: r["gemm_gflops"])
    result["roofs"] = [{**best, "gemm_gflops_runs": [roof["gemm_gflops"], end["gemm_gflops"]]}]
    for pair in result["pairs"]:
        apply_roof(pair, best["tokens_per_second"])
    return result


def run_pair(
    fmt: Format,
    prompts: list[list[int]],
    gguf: Path,
    roof: dict[str, Any],
    args: argparse.Namespace,
    work: Path,
    done: int,
    total: int,
) -> dict[str, Any]:
    from bench.vsllama.ours import run_ours

    n = len(prompts)
    log(f"[{done}/{total}] ours, {fmt.name} experts, {n} prompts...")
    ours = run_ours(args.model.resolve(), prompts, args.gen_len, fmt, args.threads, args.micro_batch_size)
    log(f"[{done}/{total}] llama.cpp, {fmt.gguf}, {n} prompts...")
    llama = run_llama(gguf, prompts, args, work)
    pair = make_pair(fmt, n, args.gen_len, roof["tokens_per_second"], ours, llama)
    log(
        f"[{done}/{total}] {fmt.label}, {n} prompts: decode ours {pair['ours']['decode_tokens_per_second']:.1f} / "
        f"llama.cpp {pair['llama_cpp']['decode_tokens_per_second']:.1f} tok/s = {pair['decode_ratio']:.2f}x"
    )
    return pair


def merge(paths: list[Path]) -> dict[str, Any]:
    """Several runs' JSON as one (each pair keeps the roof of its own run)."""
    runs = [json.loads(p.read_text()) for p in paths]
    out = {**runs[0], "runs": [str(p) for p in paths], "roofs": [], "pairs": [], "workloads": {}}
    for r in runs:
        ran = [f"{p['format']} N={p['prompts']}" for p in r["pairs"]]
        out["roofs"] += [{**roof, "run": ", ".join(ran)} for roof in r["roofs"]]
        out["pairs"] += r["pairs"]
        out["workloads"].update(r["workloads"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        result = merge(args.report)
    else:
        problem = llama_cpp_problem()
        if problem:
            sys.stderr.write(f"{NO_LLAMA}\n{problem}\n")
            return 2
        result = compare(args)
    print(render(result["pairs"], result["roofs"]))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
