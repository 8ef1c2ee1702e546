"""The digest a failed real-engine test's report carries (tests/log_digest.py): the lines
that explain a failure, and the stacks of a stall of the in-process services' loop whole."""

from __future__ import annotations

from tests.log_digest import digest
from tools.cluster.loop_watch import LOOP_STALLS_FILE


def test_the_digest_keeps_warnings_the_failed_ids_and_the_stall_stacks(tmp_path):
    (tmp_path / "inprocess.log").write_text("\n".join([
        '{"event": "fine", "level": "info"}',
        '{"event": "claim", "request_id": "front-0123456789abcdef", "level": "info"}',
        '{"event": "other", "request_id": "front-fedcba9876543210", "level": "info"}',
        '{"event": "event_loop_blocked", "level": "warning"}']))
    stacks = ["Timeout (0:00:10)!", "Thread 0x00007f (most recent call first):",
              '  File "common/transport/plan.py", line 98 in slot_array']
    (tmp_path / LOOP_STALLS_FILE).write_text("\n".join(stacks))
    out = digest(tmp_path, "AssertionError: front-0123456789abcdef hung", total=3)
    lines = out.splitlines()
    assert lines[0] == "request ids in the failure: ['front-0123456789abcdef']"
    assert any("front-0123456789abcdef" in ln for ln in lines)
    assert not any("front-fedcba9876543210" in ln or '"fine"' in ln for ln in lines)
    # the stacks come last and whole, whatever the other files' lines were cut to
    assert lines[-3:] == stacks and "stall" in lines[-4]


def test_a_digest_of_no_logs_says_so(tmp_path):
    assert "no log file" in digest(tmp_path, "boom")
