"""structlog set-up: JSON lines off a terminal, console rendering on one; ISO UTC timestamps. And the
standard streams made unbreakable: a reader that went away (`up | head -1`, a closed terminal) must
cost the log lines, never the service (docs/reliability.md, "What one request may cost")."""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import Any, TextIO

import structlog

GONE = (errno.EPIPE, errno.EIO, errno.ENXIO, errno.EBADF)  # the reader or the terminal is gone


class UnbreakableStream:
    """A standard stream whose reader may vanish. The first write or flush that finds it gone points the
    descriptor at /dev/null (so the C libraries writing to it, gRPC's among them, and the children that
    inherited it carry on too) and drops what was pending; everything else passes through."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def _gone(self) -> None:
        self.broken = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError):  # no descriptor to repoint: later writes are dropped here
            pass

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno not in GONE:
                raise
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno not in GONE:
                raise
            self._gone()
            try:  # the buffer still holds what failed; on /dev/null now, it goes
                self._stream.flush()
            except (OSError, ValueError):
                pass

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, buffer, encoding, ...
        return getattr(self._stream, name)


def guard_standard_streams() -> None:
    """sys.stdout and sys.stderr as UnbreakableStream (once; idempotent)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, UnbreakableStream):
            setattr(sys, name, UnbreakableStream(stream))


def configure_logging(service: str, level: str = "info", json_logs: bool | None = None) -> structlog.BoundLogger:
    guard_standard_streams()
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)

    def add_service(_: object, __: str, event: dict) -> dict:
        # contextvars do not reach threads started later (scheduler, workers): stamp it on every line
        event.setdefault("service", service)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    return structlog.get_logger()
