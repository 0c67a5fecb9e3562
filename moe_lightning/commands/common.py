"""Flags and helpers shared by the generate and run commands."""

from __future__ import annotations

import argparse
from typing import Any

from moe_lightning.config import flags


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    flags.SEED.add_to(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_client_flags(p: argparse.ArgumentParser) -> None:
    """How to reach a stack whose public API requires TLS and/or a token."""
    flags.TLS_CA.add_to(p)
    flags.AUTH_TOKEN.add_to(p)
    p.add_argument(
        "--allow-insecure-token",
        action="store_true",
        help="send --auth-token without TLS to a non-loopback address (refused otherwise: anyone on the path reads it)",
    )


def add_where_flags(p: Any) -> None:
    """--model (a stack of this process's own, or in-process) or --addr (a running stack): one of them."""
    where = p.add_mutually_exclusive_group(required=True)
    flags.MODEL.add_to(where)
    flags.ADDR.add_to(where)
