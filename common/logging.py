"""One structlog configuration for every dualpath process.

Human-readable console output on a TTY, one JSON object per line otherwise (what a log
shipper wants). Request ids are bound with ``structlog.contextvars`` so every line logged
while handling a request carries it.
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def configure_logging(level: str = "info", json: bool | None = None, stream=None) -> None:
    """Configure structlog and the stdlib root logger; idempotent, last call wins."""
    global _configured
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info if json else structlog.dev.set_exc_info,
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=stream, force=True)
    _configured = True


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


bind_request = structlog.contextvars.bind_contextvars
unbind_request = structlog.contextvars.unbind_contextvars
bound_request = structlog.contextvars.bound_contextvars
