"""`run` keeps its finished results (issue 54): its output passed the check before the job, then a
symbolic link (or a file) appears at the name while the job works; the write that follows is refused,
and the results are kept in a private file beside the target, which the message names, instead of
being thrown away with the refusal."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gateway.errors import bad_request
from moe_lightning.commands.openai_batch import BatchLine, write_results
from moe_lightning.commands.run_job import write_table
from moe_lightning.output_files import OutputFileError, check_output_file

RESULTS = pa.table({"prompt": ["a", "b"], "text": ["x", "y"]})


def _kept(refusal: BaseException, out: Path) -> Path:
    kept = Path(str(refusal).rsplit("the results are kept in ", 1)[1])
    assert kept.parent == out.parent and kept.name.startswith(f".{out.name}.")
    st = kept.lstat()
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return kept


def test_a_link_planted_while_run_works_keeps_the_finished_results(tmp_path: Path) -> None:
    out, victim = tmp_path / "out.parquet", tmp_path / "victim"
    victim.write_bytes(b"untouched")
    check_output_file(out)  # `run` asks before the job: nothing there yet
    os.symlink(victim, out)  # ... and the link appears while the job generates
    with pytest.raises(OutputFileError, match="it is a symbolic link.*the results are kept in") as refused:
        write_table(RESULTS, out, False)  # what `run` does with its finished table
    assert victim.read_bytes() == b"untouched" and out.is_symlink()
    assert pq.read_table(_kept(refused.value, out)).equals(RESULTS)


def test_a_file_put_at_the_name_while_the_batch_ran_keeps_its_results(tmp_path: Path) -> None:
    """The OpenAI Batch output the same way: a file of ours appeared there (without --overwrite)."""
    out = tmp_path / "results.jsonl"
    check_output_file(out)
    out.write_bytes(b"someone else's run")
    with pytest.raises(OutputFileError, match="pass --overwrite.*the results are kept in") as refused:
        write_results([BatchLine("c1", error=bad_request("no"))], "m", out)
    assert out.read_bytes() == b"someone else's run"
    assert b'"custom_id":"c1"' in _kept(refused.value, out).read_bytes()
