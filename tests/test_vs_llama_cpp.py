"""bench/vs_llama_cpp.py (issue 34, item 4): what runs without llama.cpp (the prompts both systems get,
the formats' pairing, the roof's arithmetic, packing prompts into prefill batches, the converter taken
out of llama-cpp-python's sdist, the pre-tokenizer the demo tokenizer is given, ours' phases through a
real stack, the report, its goals and merging runs, a llama.cpp process killed by a signal run again
without its extra buffer types), then the whole script on the tiny model, skipped
where llama_cpp is not importable (it is the optional `bench-llama` extra, which CI does not build)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gpucheck.workload import bench_prompts  # noqa: E402
from bench.vs_llama_cpp import run_worker  # noqa: E402
from bench.vsllama.convert_hf import is_gpt2_byte_level  # noqa: E402
from bench.vsllama.formats import FORMATS, parse_formats  # noqa: E402
from bench.vsllama.gguf_files import extract_converter  # noqa: E402
from bench.vsllama.llama_worker import pack_prompts  # noqa: E402
from bench.vsllama.report import goals, llama_rates, make_pair, render  # noqa: E402
from bench.vsllama.roof import active_parameters, gemm_gflops, roof_tokens_per_second  # noqa: E402
from moe_lightning.benchmark import mtbench_lengths  # noqa: E402
from moe_lightning.demo_model import build_tokenizer, demo_config, write_demo_model  # noqa: E402
from moe_lightning.spec import ModelSpec  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("vsllama") / "tiny", "tiny", progress=False)


def test_both_systems_get_the_bench_commands_mtbench_prompts(tiny: Path) -> None:
    prompts = bench_prompts(tiny, 512, 64)
    assert [len(p) for p in prompts] == mtbench_lengths(64)
    assert all(p[0] == 1 and all(3 <= t < 512 for t in p[1:]) for p in prompts)  # BOS, then no special token
    assert bench_prompts(tiny, 512, 64) == prompts  # seeded: the same ids in every run


def test_formats_pair_ours_with_llama_cpp_file_types() -> None:
    assert [(f.quantize, f.group_size, f.gguf) for f in parse_formats("fp32,int4-g32,int4")] == [
        ("none", None, "f32"),
        ("int4", 32, "q4_0"),
        ("int4", 128, "q4_0"),
    ]
    assert FORMATS["int8"].gguf == "q8_0"
    assert [(f.quantize, f.quantize_dense, f.gguf) for f in parse_formats("int8-qd,int4-qd")] == [
        ("int8", "int8", "q8_0"),
        ("int4", "int8", "q4_0"),
    ]
    with pytest.raises(ValueError, match="int2"):
        parse_formats("fp32,int2")


def test_the_roof_counts_a_tokens_active_weights() -> None:
    params = active_parameters(ModelSpec.from_hf_config(demo_config("bench")))
    h, inter, layers, vocab = 1024, 3584, 8, 32000
    assert params == {
        "attention": layers * (2 * h * h + 2 * h * 256),  # q, o; k, v over 4 KV heads of 64
        "router": layers * h * 8,
        "experts": layers * 2 * 3 * h * inter,  # top-2 of gate, up, down
        "lm_head": vocab * h,
    }
    # the figure: 178 GFLOP/s over the bench model's 0.23 B active parameters is ~385 tok/s
    assert roof_tokens_per_second(178.0, params) == pytest.approx(387.0, abs=0.5)


def test_the_gemm_rate_is_measured() -> None:
    assert 0.1 < gemm_gflops(threads=1, size=256, repeats=2) < 10_000


def test_prompts_pack_whole_into_prefill_batches() -> None:
    assert pack_prompts([5, 3, 4, 8, 1], 8) == [[0, 1], [2], [3], [4]]
    assert pack_prompts([418] * 10, 2048) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # 4 x 418 <= 2048 < 5 x 418
    with pytest.raises(ValueError, match="more than a prefill batch"):
        pack_prompts([3, 9], 8)


def _tar_with(tmp_path: Path, names: dict[str, bytes]) -> Path:
    sdist = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in names.items():
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sdist


def test_the_converter_is_taken_out_of_the_sdist(tmp_path: Path) -> None:
    sdist = _tar_with(
        tmp_path,
        {
            "vendor/llama.cpp/convert_hf_to_gguf.py": b"main",
            "vendor/llama.cpp/conversion/llama.py": b"model",
            "vendor/llama.cpp/gguf-py/gguf/__init__.py": b"gguf",
            "vendor/llama.cpp/ggml/src/ggml.c": b"not needed",
            "llama_cpp/llama_cpp.py": b"bindings",
        },
    )
    extract_converter(sdist, tmp_path / "out")
    got = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == ["conversion/llama.py", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py"]
    with pytest.raises(RuntimeError, match="convert_hf_to_gguf.py"):
        extract_converter(_tar_with(tmp_path, {"vendor/llama.cpp/conversion/x.py": b""}), tmp_path / "none")


def test_the_demo_tokenizer_is_gpt2s_byte_level_pre_tokenizer() -> None:
    assert is_gpt2_byte_level(json.loads(build_tokenizer(512).to_str()))
    assert not is_gpt2_byte_level({"pre_tokenizer": {"type": "Metaspace"}})
    assert not is_gpt2_byte_level({"pre_tokenizer": {"type": "ByteLevel", "use_regex": False}})


def _side(decode: float, e2e: float) -> dict[str, Any]:
    return {"decode_tokens_per_second": decode, "e2e_tokens_per_second": e2e, "decode_ms_per_step": {}}


def _llama(prefill: float, decode: float, ids: list[list[int]]) -> dict[str, Any]:
    return {"prefill_seconds": prefill, "decode_seconds": decode, "decode_call_seconds": decode, "token_ids": ids}


def test_a_pair_counts_llama_cpp_as_ours_and_checks_the_goals() -> None:
    # llama.cpp: 64 prompts, 32 tokens each, prefill 10 s, decode 62 s: 64 x 31 / 62 = 32 tok/s decode
    assert llama_rates(_llama(10.0, 62.0, []), 64, 32) == pytest.approx(
        {"e2e_tokens_per_second": 64 * 32 / 72, "decode_tokens_per_second": 32.0}
    )
    ours = {**_side(80.0, 40.0), "token_ids": [[5, 6], [7, 8]]}
    pair = make_pair(FORMATS["int8"], 64, 32, 200.0, ours, _llama(10.0, 62.0, [[5, 6], [7, 9]]))
    assert pair["decode_ratio"] == pytest.approx(2.5)
    assert pair["ours_roof_share"] == pytest.approx(0.4) and pair["llama_roof_share"] == pytest.approx(0.16)
    assert pair["agreement"] == {"first_token": 1.0, "whole_sequence": 0.5}
    assert "token_ids" not in pair["ours"] and "token_ids" not in pair["llama_cpp"]
    checked = {g.what: g.met for g in goals([pair])}
    assert checked == {
        "decode ours / llama.cpp, int8 vs q8_0, 64 prompts": True,  # 2.5 >= 1.5
        "decode ours / compute roof, int8 vs q8_0, 64 prompts": False,  # 0.4 < 0.5
    }
    slow = make_pair(FORMATS["fp32"], 256, 32, 200.0, {**ours, "token_ids": [[1]]}, _llama(1.0, 62.0, [[1]]))
    # 256 prompts: the ratio goal only, and 80 tok/s against 256 x 31 / 62 = 128 is short of 2x
    assert [(g.target, g.met) for g in goals([slow])] == [(2.0, False)]


def test_the_report_merges_runs_into_one_table(tmp_path: Path) -> None:
    roof = {
        "gemm_size": 2048,
        "threads": 2,
        "gemm_gflops": 178.0,
        "active_parameters": {"a": 100},
        "tokens_per_second": 9,
    }
    runs = []
    for i, (fmt, n) in enumerate([("fp32", 64), ("int4", 256)]):
        pair = make_pair(FORMATS[fmt], n, 32, 9.0, {**_side(6.0, 3.0), "token_ids": [[1]]}, _llama(1, 31, [[1]]))
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps({"roofs": [roof], "pairs": [pair], "workloads": {str(n): {}}}))
        runs.append(path)
    merged = tmp_path / "all.json"
    r = subprocess.run(
        [sys.executable, "bench/vs_llama_cpp.py", "--report", *map(str, runs), "--json", str(merged)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith(("fp32 /", "int4 /"))]
    assert [row.split()[:4] for row in rows] == [["fp32", "/", "f32", "64"], ["int4", "/", "q4_0", "256"]]
    # fp32 at 64: decode 6 tok/s against llama.cpp's 64 x 31 / 31 s = 64 (not met), 6 / 9 = 0.67 of the roof (met)
    assert "0.09 (goal >= 1.5) NOT met" in r.stdout and "0.67 (goal >= 0.5) met" in r.stdout
    assert len(json.loads(merged.read_text())["pairs"]) == 2
    text = render(json.loads(merged.read_text())["pairs"], [roof])
    assert "= 9 tok/s" in text and "goals:" in text


def test_a_llama_cpp_killed_by_a_signal_runs_again_without_its_extra_buffers(tmp_path: Path) -> None:
    # a worker that dies as llama.cpp's AMX matmul does on some AMX CPUs unless told --no-extra-bufts
    out = tmp_path / "llama.json"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, signal, sys\n"
        "if '--no-extra-bufts' not in sys.argv:\n"
        "    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "if '--exit' in sys.argv:\n"
        "    sys.exit(3)\n"
        f"open({str(out)!r}, 'w').write(json.dumps({{'extra_bufts': False, 'decode_seconds': 2.0}}))\n"
    )
    cmd = [sys.executable, str(worker)]
    assert run_worker(cmd, out, extra_bufts=True, fallback=True) == {
        "extra_bufts": False,
        "decode_seconds": 2.0,
        "extra_bufts_fallback": "SIGSEGV with them on",
    }
    assert "extra_bufts_fallback" not in run_worker(cmd, out, extra_bufts=False, fallback=True)
    with pytest.raises(subprocess.CalledProcessError) as killed:  # --llama-extra-bufts on: no second try
        run_worker(cmd, out, extra_bufts=True, fallback=False)
    assert killed.value.returncode == -11
    with pytest.raises(subprocess.CalledProcessError):  # an error of its own is not retried
        run_worker([*cmd, "--exit"], out, extra_bufts=False, fallback=True)
    # the table stars such a llama.cpp figure and says why under it
    pair = make_pair(
        FORMATS["int8"],
        4,
        32,
        9.0,
        {**_side(6.0, 3.0), "token_ids": [[1]]},
        {**_llama(1, 31, [[1]]), "extra_bufts": False, "extra_bufts_fallback": "SIGSEGV with them on"},
    )
    text = render([pair], [])
    assert "4.0*" in text
    assert "* llama.cpp with its weights as the file has them (no repacking for this CPU, no AMX): " in text
    assert "int8 N=4: SIGSEGV with them on" in text


def test_ours_prefills_in_one_step_then_decodes_the_whole_batch(tiny: Path) -> None:
    from bench.vsllama.ours import run_ours

    prompts = bench_prompts(tiny, 512, 6)
    r = run_ours(tiny, prompts, 4, FORMATS["fp32"], threads=1)
    assert r["steps"] == {"prefill": 1, "decode": 3, "mixed": 0}
    assert r["generated_tokens"] == 24 and [len(t) for t in r["token_ids"]] == [4] * 6
    assert r["decode_tokens_per_second"] == pytest.approx(18 / r["decode_seconds"])
    assert r["decode_ms_per_step"]["orchestrator_wall"] >= r["decode_ms_per_step"]["step"] > 0
    # fp32 on a CPU: no quantized kernel, the dense GEMMs' race picks for every rows bucket decoded
    dense = r["dense_kernels"]
    assert r["kernels"] == {} and dense and all(1 in buckets for buckets in dense.values()), dense


def test_the_whole_script_on_the_tiny_model(tiny: Path, tmp_path: Path) -> None:
    # an install that does not import (a dependency missing) skips too, with its error as the reason
    pytest.importorskip("llama_cpp", reason="the optional bench-llama extra (llama-cpp-python)", exc_type=ImportError)
    out = tmp_path / "vs.json"
    cmd = [sys.executable, "bench/vs_llama_cpp.py", "--model", str(tiny), "--prompts", "4"]
    cmd += ["--formats", "fp32,int8,int4-g32", "--gen-len", "4", "--gguf-dir", str(tmp_path / "gguf")]
    r = subprocess.run([*cmd, "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(p["format"], p["gguf"]) for p in result["pairs"]] == [
        ("fp32", "f32"),
        ("int8", "q8_0"),
        ("int4-g32", "q4_0"),
    ]
    assert sorted(f.name for f in (tmp_path / "gguf").iterdir()) == [f"tiny-{t}.gguf" for t in ("f32", "q4_0", "q8_0")]
    roof = result["roofs"][0]
    assert roof["gemm_gflops"] == max(roof["gemm_gflops_runs"]) and len(roof["gemm_gflops_runs"]) == 2  # start, end
    for p in result["pairs"]:
        assert p["ours"]["decode_tokens_per_second"] > 0 and p["llama_cpp"]["decode_tokens_per_second"] > 0
        assert p["ours_roof_share"] == pytest.approx(
            p["ours"]["decode_tokens_per_second"] / result["roofs"][0]["tokens_per_second"]
        )
    # the same model on both sides: fp32 and llama.cpp's f32 pick the same first greedy token
    assert result["pairs"][0]["agreement"]["first_token"] == 1.0
    assert "fp32 / f32" in r.stdout and "decode step, ms:" in r.stdout
