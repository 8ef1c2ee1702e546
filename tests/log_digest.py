"""What a failed real-engine test's logs say, short enough for a CI log's tail.

A real-engine test runs a dozen processes (vLLM instances, a front, node services) that each
log to a file under the test's ``tmp_path``, and the in-process services log to
``inprocess.log`` there (tests/conftest.py). CI runs on a clean clone that is deleted after, so
those files are gone when a failure is read: what a failure report must carry is the lines
that explain it — every warning and error, and every line naming a request id the failure
message names — per file, the most recent last — and, whole, the stacks the in-process
services' loop watchdog dumped during a stall (``loop-stalls.log``: tools/cluster/loop_watch.py).
The conftest hook appends this digest to the failed test's report.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.cluster.loop_watch import LOOP_STALLS_FILE

# a request id as the front, the scheduler, the nodes and the connector log it
RID = re.compile(r"\bfront-[0-9a-f]{8,32}\b")
# a JSON log line (structlog) at warning or above, or a vLLM / stdlib line at WARNING or above
SEVERE = re.compile(r'"level": ?"(warning|error|critical)"|\b(WARNING|ERROR|CRITICAL)\b'
                    r'|Traceback|Error:')
LINE_CHARS = 400
STALL_LINES = 80


def digest(root: Path, failure: str, per_file: int = 12, total: int = 150) -> str:
    """Per log file under ``root``: its last ``per_file`` lines naming a request id of
    ``failure`` and its last ``per_file`` warnings and errors, in file order (``total`` lines
    at most, the most recent kept)."""
    rids = set(RID.findall(failure))
    out: list[str] = []
    stalls: list[str] = []
    for path in sorted(root.rglob("*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError as e:
            out.append(f"== {path.relative_to(root)}: unreadable ({e})")
            continue
        lines = text.splitlines()
        if path.name == LOOP_STALLS_FILE and lines:   # faulthandler's dumps: the stacks,
            stalls.append(f"== {path.relative_to(root)} (every thread's stack during a stall "
                          f"of the in-process services' loop; the last {STALL_LINES} lines):")
            stalls.extend(ln[:LINE_CHARS] for ln in lines[-STALL_LINES:])    # kept whole
            continue
        named = [i for i, ln in enumerate(lines) if any(r in ln for r in rids)]
        severe = [i for i, ln in enumerate(lines) if SEVERE.search(ln)]
        picked = sorted(set(named[-per_file:]) | set(severe[-per_file:]))
        if not picked:
            continue
        out.append(f"== {path.relative_to(root)} ({len(lines)} lines; {len(named)} name the "
                   f"request ids, {len(severe)} warn or fail; the last {per_file} of each):")
        out.extend(lines[i][:LINE_CHARS] for i in picked)
    if len(out) > total:
        out = [f"... {len(out) - total} earlier lines left out", *out[-total:]]
    out += stalls
    head = f"request ids in the failure: {sorted(rids) or 'none'}"
    return "\n".join([head, *out]) if out else head + "\n(no log file under the test's tmp_path)"
