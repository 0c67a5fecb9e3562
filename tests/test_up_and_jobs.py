"""`moe-lightning up`, the client CLI and the offline `run` job, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moe_lightning.shm.segment import list_segments

from processes import UpProcess, cli


@pytest.fixture(scope="module")
def up(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    u = UpProcess(tiny_model, f"up{os.getpid()}", tmp_path_factory.mktemp("uplogs"), "--stream-interval", "2")
    u.read_endpoints()
    yield u
    if u.proc.poll() is None:
        u.stop(signal.SIGTERM)


def test_up_prints_endpoints_of_all_services(up: UpProcess) -> None:
    assert set(up.endpoints) == {"weight_store", "cpu_attention", "gpu_expert", "orchestrator", "gateway"}
    assert up.endpoints["gateway"]["http"].startswith("http://127.0.0.1:")  # the OpenAI API, loopback too
    for name in ("weight_store", "cpu_attention", "gpu_expert"):
        assert up.endpoints[name]["grpc"].startswith("unix://")  # internal services: no TCP port
    assert list_segments(up.run_id)  # the arena, the KV cache and both channels exist


def test_generate_client_matches_in_process(up: UpProcess, tiny_model: Path) -> None:
    args = ["--prompt", "Hello there", "--max-new-tokens", "9", "--ignore-eos", "--json"]
    remote = cli("generate", "--addr", up.addr, *args)
    local = cli("generate", "--model", str(tiny_model), "--no-progress", *args)
    assert remote.returncode == 0, remote.stderr
    assert local.returncode == 0, local.stderr
    r, loc = json.loads(remote.stdout), json.loads(local.stdout)
    assert r["token_ids"] == loc["token_ids"] and r["text"] == loc["text"] and r["finish_reason"] == "length"


def test_streamed_text_adds_up_and_never_shows_the_stop(up: UpProcess) -> None:
    """GenerateStream's text pieces: incremental, held back near a possible stop string, adding up
    to the final text; each piece carries its tokens' log-probabilities when asked."""
    from moe_lightning.client import Completion, GenerationClient, Prompt, StreamChunk

    with GenerationClient(up.addr, timeout=120) as c:
        full = c.generate(Prompt(text="Once upon a time", max_new_tokens=24, ignore_eos=True))
        stop = full.text[8:11]
        assert len(stop) == 3 and stop.strip()
        parts = list(
            c.stream(Prompt(text="Once upon a time", max_new_tokens=24, ignore_eos=True, stop=[stop], logprobs=2))
        )
    *pieces, final = parts
    assert isinstance(final, Completion) and all(isinstance(p, StreamChunk) for p in pieces)
    assert final.finish_reason == "stop" and final.text == full.text[: full.text.find(stop)]
    assert "".join(p.text for p in pieces) == final.text  # the held text arrives with the last message
    assert sum(bool(p.text) for p in pieces) > 1  # text came as it was generated, not all at the end
    assert all(len(p.token_ids) >= 2 for p in pieces[:-1])  # `up --stream-interval 2`: two tokens a message
    assert [t for p in pieces for t in p.token_ids] == final.token_ids == full.token_ids[: len(final.token_ids)]
    assert [lp["token_id"] for p in pieces for lp in p.logprobs] == final.token_ids
    assert all(len(lp["top_token_ids"]) == 2 for p in pieces for lp in p.logprobs)
    # the CLI prints the same text as it streams
    r = cli(
        "generate",
        "--addr",
        up.addr,
        "--prompt",
        "Once upon a time",
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--stop",
        stop,
        "--stream",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == final.text + "\n" and "[stop, " in r.stderr


def test_run_job_against_running_stack(up: UpProcess, tmp_path: Path, tiny_model: Path) -> None:
    from moe_lightning.tokenizer import TextTokenizer

    tok = TextTokenizer.from_model_dir(tiny_model)
    assert tok is not None
    table = pa.table(
        {
            "prompt": ["The sea is", None, "Once upon a time", "Hi"],
            "prompt_ids": [None, [1, 5, 6, 7], None, None],
            "max_new_tokens": [5, 7, None, 3],
            "seed": [None, None, 3, None],
            "temperature": [None, None, 0.9, None],
            "id": [10, 11, 12, 13],
        }
    )
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    out = tmp_path / "out.parquet"
    r = cli(
        "run",
        "--addr",
        up.addr,
        "--input",
        str(src),
        "--output",
        str(out),
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--no-progress",
        "--chunk-size",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "4 prompts" in r.stderr and "generated tok/s" in r.stderr
    rows = pq.read_table(out).to_pylist()
    assert [row["id"] for row in rows] == [10, 11, 12, 13]  # input order and columns kept
    assert [row["completion_tokens"] for row in rows] == [5, 7, 4, 3]  # per-row max_new_tokens, else the flag
    assert rows[1]["prompt_tokens"] == 4 and rows[0]["prompt_tokens"] == len(tok.encode("The sea is"))
    assert all(row["finish_reason"] == "length" and row["latency_seconds"] > 0 for row in rows)
    # the same job again into the same file: refused before it runs, then done with --overwrite (the
    # greedy rows identical, the seeded row reproducible); a symbolic link there is never written through
    job = ["run", "--addr", up.addr, "--input", str(src), "--max-new-tokens", "4", "--ignore-eos", "--no-progress"]
    refused = cli(*job, "--output", str(out))
    assert refused.returncode == 2, refused.stderr
    assert f"refusing to write the output {out}: it exists (pass --overwrite" in refused.stderr
    assert pq.read_table(out).to_pylist() == rows
    link, victim = tmp_path / "link.parquet", tmp_path / "victim"
    victim.write_bytes(b"precious")
    link.symlink_to(victim)
    r2 = cli(*job, "--output", str(link), "--overwrite")
    assert r2.returncode == 2 and "it is a symbolic link" in r2.stderr and victim.read_bytes() == b"precious"
    r2 = cli(*job, "--output", str(out), "--overwrite")
    assert r2.returncode == 0, r2.stderr
    assert [x["token_ids"] for x in pq.read_table(out).to_pylist()] == [row["token_ids"] for row in rows]
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "link.parquet", "out.parquet", "victim"]  # no temp left


def test_sigterm_stops_everything_and_leaves_no_segment(up: UpProcess) -> None:
    assert up.stop(signal.SIGTERM) == 0
    assert list_segments(up.run_id) == []
    assert up.proc.stdout is not None


def test_ctrl_c_and_jsonl_run_with_its_own_stack(tiny_model: Path, tmp_path: Path) -> None:
    u = UpProcess(tiny_model, f"upc{os.getpid()}", tmp_path / "logs")
    u.read_endpoints()
    assert u.stop(signal.SIGINT) == 0
    assert list_segments(u.run_id) == []
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": p}) for p in ["a b c", "d e f g"]) + "\n")
    r = cli(
        "run",
        "--model",
        str(tiny_model),
        "--input",
        str(src),
        "--output",
        str(tmp_path / "o.parquet"),
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "--no-progress",
        "--run-id",
        f"job{os.getpid()}",
    )
    assert r.returncode == 0, r.stderr
    assert len(pq.read_table(tmp_path / "o.parquet")) == 2
    assert list_segments(f"job{os.getpid()}") == []


def test_bad_inputs_to_the_job(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt\nhi\n")
    r = cli("run", "--addr", "127.0.0.1:1", "--input", str(bad), "--output", str(tmp_path / "o.parquet"))
    assert r.returncode == 2 and "must be .parquet or .jsonl" in r.stderr
    nocol = tmp_path / "x.jsonl"
    nocol.write_text('{"text": "hi"}\n')
    r = cli("run", "--addr", "127.0.0.1:1", "--input", str(nocol), "--output", str(tmp_path / "o.parquet"))
    assert r.returncode == 2 and "needs a 'prompt'" in r.stderr
