"""``make aiperf-front``: AIPerf's multi-turn chat benchmark against the dualpath front.

What a user of the front runs to check it serves a standard OpenAI load generator: ``dualpath
cluster up`` of a real-engine cluster file (default ``configs/vllm-1p1d.toml``, its fixed ports
made free ones, state and storage in a temporary directory: ``real_engines.on_loopback``),
then AIPerf 0.13 (``make aiperf-env``: its own venv) with synthetic multi-turn conversations
over ``/v1/chat/completions``, streamed — each turn sends the whole conversation so far, so
from turn 2 the prompt starts with what the previous turn stored — then the cluster stops.

Prints AIPerf's request count, errors, TTFT and latency, and what dualpath did (the scheduler's
read-side tokens: the prompt tokens loaded from storage, per side; AIPerf's own prompt-cache
metrics come from the front's ``usage.prompt_tokens_details.cached_tokens`` and must add up to
them); writes ``<out>/aiperf-front.json`` and AIPerf's artifacts under ``<out>/aiperf``. Exit 1
on any AIPerf error, an unfinished run, or cached tokens that differ from what was loaded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def aiperf_argv(aiperf: str, url: str, model: Path, out: Path, a: argparse.Namespace
                ) -> list[str]:
    return [aiperf, "profile", "--model-names", "smollm2", "--url", url,
            "--endpoint-type", "chat", "--streaming", "--tokenizer", str(model),
            "--conversation-num", str(a.conversations),
            "--conversation-turn-mean", str(a.turns), "--conversation-turn-stddev", "0",
            "--concurrency", str(a.concurrency),
            "--prompt-input-tokens-mean", str(a.input_tokens), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(a.output_tokens),
            "--prompt-output-tokens-stddev", "0", "--random-seed", "7",
            "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--output-artifact-dir", str(out)]


def read_sides(metrics_url: str) -> dict[str, float]:
    """The scheduler's ``dualpath_read_side_tokens_total`` per side."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {s.labels["side"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "dualpath_read_side_tokens_total"}


def summary(export: dict[str, Any], sides: dict[str, float]) -> dict[str, Any]:
    def stat(name: str) -> dict[str, Any]:
        m = export.get(name) or {}
        return {k: m.get(k) for k in ("avg", "p50", "p99", "unit")}
    return {"requests": (export.get("request_count") or {}).get("avg"),
            "errors": len(export.get("error_summary") or []),
            "complete": bool(export.get("is_complete")) and not export.get("was_cancelled"),
            "ttft_ms": stat("time_to_first_token"), "latency_ms": stat("request_latency"),
            "inter_token_ms": stat("inter_token_latency"),
            "input_tokens": stat("input_sequence_length"),
            "request_throughput": stat("request_throughput"),
            "cached_prompt_tokens": (export.get("total_usage_prompt_cache_read_tokens")
                                     or {}).get("avg"),
            "cached_prompt_pct": (export.get("overall_usage_prompt_cache_read_pct")
                                  or {}).get("avg"),
            "loaded_tokens_by_side": sides}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.aiperf_front",
                                description=__doc__.splitlines()[0])
    p.add_argument("--aiperf", default=".venv-aiperf/bin/aiperf", help="AIPerf's executable")
    p.add_argument("--config", default="configs/vllm-1p1d.toml")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-tokens", type=int, default=200, help="new user tokens per turn")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--out", default="results/aiperf-front")
    a = p.parse_args(argv)
    if a.turns * (a.input_tokens + a.output_tokens + 40) > 1900:
        p.error("turns x (input + output tokens) must stay under the instances' 2,048-token "
                "context (the conversation grows by every turn)")
    if not Path(a.aiperf).exists():
        print(f"{a.aiperf} is missing: run `make aiperf-env`", file=sys.stderr)
        return 2
    from common.logging import configure_logging
    from tools.cluster.launcher import Launcher
    from tools.cluster.real_engines import on_loopback, resolve_model

    configure_logging("warning", None)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dualpath-aiperf-") as tmp:
        cluster = on_loopback(a.config, Path(tmp), metrics=True)   # read-side counters
        model = resolve_model(cluster)
        launcher = Launcher(cluster, echo=print)
        try:
            state = launcher.up()
            front = str(state.proc("front").url)
            t0 = time.monotonic()
            run = subprocess.run(aiperf_argv(str(Path(a.aiperf).resolve()), front, model,
                                             out / "aiperf", a),
                                 cwd=out, capture_output=True, text=True, timeout=3600)
            wall = time.monotonic() - t0
            sched = state.proc("scheduler")
            sides = read_sides(f"http://{sched.host}:{sched.metrics_port}/metrics")
        finally:
            launcher.down()
    (out / "aiperf.log").write_text(run.stdout + run.stderr)
    try:
        export = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())
    except (OSError, ValueError):
        print(f"AIPerf wrote no results (exit {run.returncode}); its output: {out}/aiperf.log\n"
              + (run.stdout + run.stderr)[-3000:], file=sys.stderr)
        return 1
    res = {"command": " ".join(aiperf_argv("aiperf", "$FRONT", model, Path("$OUT"), a)),
           "aiperf_exit": run.returncode, "wall_s": wall, **summary(export, sides)}
    (out / "aiperf-front.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    # the hit AIPerf read from usage.prompt_tokens_details is what dualpath loaded
    ok = (run.returncode == 0 and res["errors"] == 0 and res["complete"]
          and res["cached_prompt_tokens"] == sum(sides.values()))
    print(f"AIPerf: {res['requests']:.0f} requests, {res['errors']} errors; TTFT p50 "
          f"{res['ttft_ms']['p50']:.0f} ms; loaded from storage {sides}; "
          + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
