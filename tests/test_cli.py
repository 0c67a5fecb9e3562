"""The user CLI as a user runs it: separate processes, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moe_lightning.tokenizer import TextTokenizer


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
    r = run_cli("generate", "--model", str(d), "--prompt", "hi")
    assert r.returncode != 0 and "pass --prompt-ids" in r.stderr
    r = run_cli(
        "generate", "--model", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--ignore-eos", "--no-progress"
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3  # ids printed when there is no tokenizer


def test_errors_are_one_clear_line(tmp_path: Path, tiny_model: Path) -> None:
    r = run_cli("generate", "--model", str(tmp_path), "--prompt-ids", "1")
    assert r.returncode == 2 and "config.json not found" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1,9999")
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr
    r = run_cli("generate", "--model", str(tiny_model), "--prompt-ids", "1", "--top-p", "0")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr
