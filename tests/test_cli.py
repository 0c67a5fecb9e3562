"""The user CLI as a user runs it: separate processes, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moe_lightning.tokenizer import TextTokenizer

# The command line's own process with torch made unimportable: what it does without torch must
# not import it (the services it starts are other processes, with torch).
_WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, NoTorch())
import moe_lightning.client, moe_lightning.launcher
from moe_lightning.cli import main
sys.exit(main(sys.argv[1:]))
"""


def without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=120)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_make_demo_model_is_deterministic_and_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import MixtralForCausalLM

    for name in ("a", "b"):
        r = run_cli("make-demo-model", "--preset", "tiny", "--out", str(tmp_path / name), "--seed", "5")
        assert r.returncode == 0, r.stderr
    for f in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    model = MixtralForCausalLM.from_pretrained(tmp_path / "a")
    tok = TextTokenizer.from_model_dir(tmp_path / "a")
    assert tok is not None and tok.vocab_size == model.config.vocab_size == 512
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_generate_json_text_and_ids(tiny_model: Path) -> None:
    r = run_cli(
        "generate",
        "--model",
        str(tiny_model),
        "--prompt",
        "Hello there",
        "--max-new-tokens",
        "7",
        "--ignore-eos",
        "--json",
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 7 and out["finish_reason"] == "length"
    assert isinstance(out["text"], str) and out["prompt_tokens"] >= 2
    assert out["timings"]["generated_tokens_per_second"] > 0
    tok = TextTokenizer.from_model_dir(tiny_model)
    assert tok is not None
    ids = ",".join(map(str, tok.encode("Hello there")))
    r2 = run_cli(
        "generate",
        "--model",
        str(tiny_model),
        "--prompt-ids",
        ids,
        "--json",
        "--no-progress",
        env={"MOE_LIGHTNING_MAX_NEW_TOKENS": "7", "MOE_LIGHTNING_IGNORE_EOS": "1"},
    )
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["token_ids"] == out["token_ids"]


def test_generate_without_tokenizer_needs_ids(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "notok"
    shutil.copytree(tiny_model, d)
    (d / "tokenizer.json").unlink()
    r = without_torch("generate", "--model", str(d), "--prompt", "hi")  # refused before torch is imported
    assert r.returncode != 0 and "pass --prompt-ids" in r.stderr
    r = run_cli(
        "generate", "--model", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--ignore-eos", "--no-progress"
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3  # ids printed when there is no tokenizer


def test_errors_are_one_clear_line(tmp_path: Path, tiny_model: Path) -> None:
    """In-process generation checks the checkpoint, the prompts and the flags before it imports torch."""
    r = without_torch("generate", "--model", str(tmp_path), "--prompt-ids", "1")
    assert r.returncode == 2 and "config.json not found" in r.stderr and "Traceback" not in r.stderr
    r = without_torch("generate", "--model", str(tiny_model), "--prompt-ids", "1,9999")
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr
    r = without_torch("generate", "--model", str(tiny_model), "--prompt-ids", "1", "--top-p", "0")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr


def test_planning_refusals_the_client_and_a_job_need_no_torch(tiny_model: Path, tmp_path: Path) -> None:
    """`--help`, `plan`, a refused flag or input file answer without importing torch (a fraction of a
    second, not the seconds its import takes), and so do the Python client and the launcher: a job
    driven by `run --model` imports it only in the services it starts (docs/api.md, "The command line")."""
    r = without_torch("plan", "--arch", "mixtral-8x7b", "--hardware", "t4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["predicted_decode_tokens_per_second"] > 0
    r = without_torch("plan", "--arch", "gpt5", "--hardware", "t4")
    assert r.returncode == 2 and "unknown --arch 'gpt5'" in r.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt\nhi\n")
    r = without_torch("run", "--addr", "127.0.0.1:1", "--input", str(bad), "--output", str(tmp_path / "o.parquet"))
    assert r.returncode == 2 and "must be .parquet or .jsonl" in r.stderr and "Traceback" not in r.stderr
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"story {i}"}) + "\n" for i in range(40)))
    out = tmp_path / "out.parquet"
    argv = ["run", "--model", str(tiny_model), "--input", str(src), "--output", str(out), "--max-new-tokens", "3"]
    r = without_torch(*argv, "--ignore-eos", "--no-progress", "--run-id", f"nt{os.getpid()}")
    assert r.returncode == 0, r.stderr
    import pyarrow.parquet as pq

    assert pq.read_table(out).column("completion_tokens").to_pylist() == [3] * 40
