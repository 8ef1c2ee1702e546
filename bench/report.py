"""Shared output of every benchmark: a printed table and the ``--out`` JSON with a headline.

Every benchmark compares against a baseline measured in the same run and prints ratios; the
JSON's top-level ``headline`` holds the one number its issue asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The table printer lives in the tools layer (the demo prints the same tables); every
# benchmark imports it from here.
from tools.tables import print_table

__all__ = ["bench_parser", "headline", "print_table", "write_results", "send_json", "read_json"]


def bench_parser(name: str, description: str,
                 quick_takes: str = "under 60 s") -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes (``--quick``, ``--out``).

    ``quick_takes`` is what ``--quick`` costs on the 2-core reference host, for the help text:
    under a minute for every benchmark except those that start real vLLM instances."""
    p = argparse.ArgumentParser(prog=f"dualpath bench {name}", description=description)
    p.add_argument("--quick", action="store_true",
                   help=f"reduced run ({quick_takes} on a 2-core host)")
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    return p


def headline(metric: str, value: float, goal: float, higher_is_better: bool = True) -> dict[str, Any]:
    return {"metric": metric, "value": value, "goal": goal, "higher_is_better": higher_is_better,
            "met": (value >= goal) if higher_is_better else (value <= goal)}


def write_results(out: Path | None, name: str, head: dict[str, Any], results: dict[str, Any]) -> None:
    """Write the benchmark JSON (headline + full results + host info) if ``out`` is set."""
    print(f"\nheadline: {head['metric']} = {head['value']:.4g} (goal "
          f"{'>=' if head['higher_is_better'] else '<='} {head['goal']}) "
          f"{'MET' if head['met'] else 'NOT MET'}")
    if out is None:
        return
    doc = {"benchmark": name, "headline": head, "results": results,
           "host": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(f"results written to {out}")


def send_json(child, cmd: dict) -> None:
    """Send one JSON-lines command to a benchmark's peer process (its stdin)."""
    child.stdin.write(json.dumps(cmd) + "\n")
    child.stdin.flush()


async def read_json(child, what: str) -> dict:
    """Read one JSON-lines reply from a peer process without blocking the event loop."""
    line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
    if not line:
        raise RuntimeError(f"benchmark {what} process exited")
    return json.loads(line)


class Spinner:
    """A process busy on one core for the time of a ``with`` block: a benchmark's ``busy`` rows
    (how a path holds up when another job takes a core, as on a shared host).

    The block starts once the child is spinning (it says so on its stdout), not while its
    interpreter still starts: that start-up (~30 ms of CPU) would otherwise fall into the first
    timed round."""

    START_DEADLINE_S = 30.0

    def __enter__(self) -> Spinner:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdout.write('1'); sys.stdout.flush()\n"
                                   "while True: pass"], stdout=subprocess.PIPE)
        ready, _, _ = select.select([self.proc.stdout], [], [], self.START_DEADLINE_S)
        if not ready or not self.proc.stdout.read(1):
            self.__exit__()
            raise RuntimeError(f"the busy-core process did not start within {self.START_DEADLINE_S} s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
