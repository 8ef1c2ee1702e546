"""Shared fixtures: structlog to stderr in plain text, nothing else global."""

from __future__ import annotations

import contextlib
import logging
import os

# The simulator runs interpreted in the test process (and the processes it starts), whatever
# compiled build sits in the user's cache: tests monkeypatch and inspect sim internals, and which
# build a process gets must not depend on import order. tests/test_sim_accel.py checks the
# compiled build against the interpreted one in child processes of its own.
os.environ["DUALPATH_SIM_ACCEL"] = "0"

import pytest
import structlog

from common.logging import configure_logging


@pytest.fixture(autouse=True, scope="session")
def _logging() -> None:
    configure_logging("warning", json=False)


@contextlib.contextmanager
def restored_logging():
    """structlog's configuration and the stdlib root logger as they were, after the block."""
    saved, handlers, level = structlog.get_config(), logging.root.handlers[:], logging.root.level
    try:
        yield
    finally:
        structlog.configure(**saved)
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


@pytest.fixture
def keep_logging():
    """CLI entry points configure logging onto the (captured) stderr; put it back after."""
    with restored_logging():
        yield


def _starts_engines(item: pytest.Item) -> bool:
    return (item.get_closest_marker("vllm") is not None
            and item.get_closest_marker("vllm_light") is None)


@pytest.fixture(autouse=True)
def inprocess_log(request: pytest.FixtureRequest):
    """Real-engine tests: the in-process services (``local_datapath``) log at info, as JSON, to
    ``<tmp_path>/inprocess.log`` beside the vLLM and front logs — what the failure digest reads
    (tests/log_digest.py); elsewhere this is a no-op."""
    if not _starts_engines(request.node):
        yield None
        return
    path = request.getfixturevalue("tmp_path") / "inprocess.log"
    with open(path, "w", buffering=1) as stream, restored_logging():
        configure_logging("info", json=True, stream=stream)
        yield path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed real-engine test's report carries its logs' digest (tests/log_digest.py): CI
    deletes the clone, and with it every log file, before anyone reads the failure."""
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and tmp is not None and _starts_engines(item):
        from tests.log_digest import digest
        report.sections.append(("dualpath logs of this test: warnings, errors, its requests",
                                digest(tmp, str(report.longrepr))))


class ReliabilityLog:
    """Rows for ``docs/reliability.md``: what a test injected or sent, and what came of it.

    A test asserts its outcome first and records it after, so a row exists only for a case that
    held. Rows go to the JSON-lines file named by ``DUALPATH_RELIABILITY_OUT`` (set by
    ``python -m bench.reliability_report``); without it recording is a no-op.
    """

    CATEGORIES = ("fault", "durability", "input", "load", "security")

    def __init__(self, test_id: str) -> None:
        self.test_id = test_id

    def record(self, category: str, case: str, outcome: str, *, lost: int = 0,
               leaked_pages: int = 0, recovery_s: float | None = None, **extra) -> None:
        import json
        import os

        if category not in self.CATEGORIES:
            raise ValueError(f"category {category!r} not in {self.CATEGORIES}")
        path = os.environ.get("DUALPATH_RELIABILITY_OUT")
        if not path:
            return
        row = {"test": self.test_id, "category": category, "case": case, "outcome": outcome,
               "lost": int(lost), "leaked_pages": int(leaked_pages), "recovery_s": recovery_s,
               **extra}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")


@pytest.fixture
def reliability(request) -> ReliabilityLog:
    """``reliability.record(category, case, outcome, lost=, leaked_pages=, recovery_s=)``."""
    return ReliabilityLog(request.node.nodeid)
