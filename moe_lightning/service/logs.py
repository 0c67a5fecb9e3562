"""structlog set-up: JSON lines off a terminal, console rendering on one; ISO UTC timestamps."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info", json_logs: bool | None = None) -> structlog.BoundLogger:
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
