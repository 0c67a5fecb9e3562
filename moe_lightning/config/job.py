"""A batch job's typed options: what a row takes from the flags when it has no field of its own
(RowDefaults, `generate`'s and `run`'s sampling flags), and what each node of a `run --ray` job
needs of it (NodeJob: sent to the nodes as it is, not as a Namespace)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from moe_lightning.config import flags
from moe_lightning.config.flag import CliConfig, Flag, option

MAX_NEW_TOKENS = Flag("--max-new-tokens", "tokens to generate per prompt", type=int)
IGNORE_EOS = Flag("--ignore-eos", "keep generating past the EOS token", action="store_true")
TEMPERATURE = Flag("--temperature", "0 = greedy", type=float)
TOP_K = Flag("--top-k", "sample from the k most likely tokens; 0 = off", type=int)
TOP_P = Flag("--top-p", "nucleus sampling mass in (0, 1]", type=float)
STOP = Flag("--stop", "stop string (repeatable)", action="append")


@dataclass(kw_only=True)
class RowDefaults(CliConfig):
    """The sampling of a prompt that says nothing of its own (a row's fields win: batch_rows.py)."""

    max_new_tokens: int = option(MAX_NEW_TOKENS, 64)
    ignore_eos: bool = option(IGNORE_EOS, False)
    temperature: float = option(TEMPERATURE, 0.0)
    top_k: int = option(TOP_K, 0)
    top_p: float = option(TOP_P, 1.0)
    seed: int | None = option(flags.SEED)
    stop: list[str] = option(STOP, [])


@dataclass(frozen=True)
class NodeJob:
    """What one node's actor of a `run --ray` job reads: its rows' defaults, how to call its stack,
    and where the parts go."""

    rows: RowDefaults
    tls_ca: Path | None
    auth_token: str | None
    allow_insecure_token: bool
    chunk_size: int
    in_flight: int
    output_spec: str

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> NodeJob:
        return cls(
            RowDefaults.from_cli_args(ns),
            ns.tls_ca,
            ns.auth_token,
            ns.allow_insecure_token,
            ns.chunk_size,
            ns.in_flight,
            ns.output_spec,
        )
