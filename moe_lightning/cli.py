"""The `moe-lightning` command line. Every flag can also be set by environment variable:
`--max-new-tokens` is MOE_LIGHTNING_MAX_NEW_TOKENS, and so on."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import grpc

from moe_lightning.commands import bench, demo_model, generate, plan, profile, run_job, timeline, up
from moe_lightning.config.choices import LOG_LEVELS
from moe_lightning.config.flag import CommandParser, EnvDefaultsParser
from moe_lightning.service.logs import configure_logging

COMMANDS = {
    "make-demo-model": demo_model,
    "generate": generate,
    "up": up,
    "run": run_job,
    "plan": plan,
    "profile": profile,
    "timeline": timeline,
    "bench": bench,
}


def build_parser() -> EnvDefaultsParser:
    parser = EnvDefaultsParser(prog="moe-lightning", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name, module in COMMANDS.items():
        module.add_parser(sub, name)
    return parser


# errors that are the user's to fix (a bad checkpoint, flag or path), printed as one line, exit 2
USER_ERRORS = (
    ("moe_lightning.spec", "ModelSpecError"),
    ("moe_lightning.checkpoint_error", "CheckpointError"),
    ("moe_lightning.launcher", "StackError"),
)


def _is_user_error(exc: BaseException) -> bool:
    # only modules this run imported can have raised their errors: importing the others to ask would
    # cost torch's import (seconds) on a command that never needed it (`plan`, a refused input file)
    kinds = [ValueError, OSError]
    kinds += [getattr(sys.modules[m], name) for m, name in USER_ERRORS if m in sys.modules]
    return isinstance(exc, tuple(kinds))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the log on stderr (a reader that left, `up | head -1`, costs the output, not the stack or the job):
    # stdout is the command's result (`generate --json`), unconfigured structlog would print there
    # (a bad MOE_LIGHTNING_LOG_LEVEL is refused by the commands that take --log-level, not by every one)
    level = os.environ.get("MOE_LIGHTNING_LOG_LEVEL", "info").lower()
    configure_logging("cli", level if level in LOG_LEVELS else "info")
    try:
        return COMMANDS[args.command].run(args)
    except grpc.RpcError as exc:
        sys.stderr.write(f"error: {exc.code().name}: {exc.details()}\n")  # type: ignore[attr-defined]
        return 1
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        sys.stderr.write(f"error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
