"""The pieces of bench/vs_llama_cpp.py (issue 34, item 4): our stack against llama.cpp's batched
decode on the same checkpoint, prompts and threads. `formats` pairs our expert formats with llama.cpp's
file types, `roof` is the compute roof, `gguf_files` and `convert_hf` make the GGUF files with the
converter llama-cpp-python ships, `llama_worker` runs llama.cpp (a subprocess per run), `ours` runs our
stack, `report` makes the table and the goal check."""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the table)."""
    sys.stderr.write(f"[vs_llama_cpp {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()
