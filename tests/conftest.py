"""Shared fixtures: structlog to stderr in plain text, nothing else global."""

from __future__ import annotations

import pytest

from common.logging import configure_logging


@pytest.fixture(autouse=True, scope="session")
def _logging() -> None:
    configure_logging("warning", json=False)
