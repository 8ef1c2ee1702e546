"""Shared fixtures: structlog to stderr in plain text, nothing else global."""

from __future__ import annotations

import logging

import pytest
import structlog

from common.logging import configure_logging


@pytest.fixture(autouse=True, scope="session")
def _logging() -> None:
    configure_logging("warning", json=False)


@pytest.fixture
def keep_logging():
    """CLI entry points configure logging onto the (captured) stderr; put it back after."""
    saved, handlers, level = structlog.get_config(), logging.root.handlers[:], logging.root.level
    yield
    structlog.configure(**saved)
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)
