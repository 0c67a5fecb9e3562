"""Flags and helpers shared by the generate and run commands."""

from __future__ import annotations

import argparse
from typing import Any

from moe_lightning.config import flags
from moe_lightning.config.job import RowDefaults


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    RowDefaults.add_cli_args(p)


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
