"""One long-lived vLLM instance for the real-engine tests (runs in .venv-vllm).

``--role plain``: no connector, prefix caching off (the reference: it computes every prompt
token). ``--role prefill`` / ``decode``: the DualPathConnector attached to a node's engine
socket (kv_producer / kv_consumer), with vLLM's default prefix caching (on: its local hit
next to the dualpath hit, docs/vllm.md "Prefix caching"). ``--role example``: vLLM's bundled
ExampleConnector over ``--store`` (the peer row of ``dualpath bench engine``; prefix caching
off, so it loads every repeat). Prints ``READY`` once loaded, then answers one JSON line per request line on
stdin — ``{"prompt": [ids], "max_tokens": n, "dualpath": {...} | null}`` →
``{"tokens": [...], "dualpath": {...}, "ttft_s": s}`` — and exits at EOF.

``--stepwise``: requests run concurrently. A request line carries an ``"id"``; it is added to
the running engine at once (``{"id", "event": "added", "t"}``), every engine step that gives
it tokens prints ``{"id", "event": "tokens", "n", "t"}`` (its token count so far, a monotonic
time), and its end ``{"id", "event": "done", "tokens", "dualpath"}`` — what the tests use to
see one request decode while another waits for its KV.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import sys
import threading
import time


def build(a: argparse.Namespace):
    from vllm import LLM

    kw: dict = dict(model=a.model, max_model_len=a.max_model_len, enforce_eager=True,
                    dtype=a.dtype, enable_prefix_caching=a.role in ("prefill", "decode"),
                    max_num_batched_tokens=a.max_model_len, gpu_memory_utilization=0.2)
    if a.role == "example":
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": a.store}}
    elif a.role != "plain":
        kw["kv_transfer_config"] = {
            "kv_connector": "DualPathConnector",
            "kv_connector_module_path": "integrations.vllm.connector",
            "kv_role": "kv_producer" if a.role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": "fail" if a.role == "prefill" else "recompute",
            "kv_connector_extra_config": {"source": "engine", "engine_socket": a.socket,
                                          "engine_id": a.engine_id, "kv_preset": a.preset,
                                          "layer_timeout_s": 30.0},
        }
    return LLM(**kw)


def params(req: dict):
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"dualpath": req["dualpath"]}} if req.get("dualpath") else None
    return SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], extra_args=extra,
                          ignore_eos=bool(req.get("ignore_eos", False)))


def serve(llm, lines, out) -> None:
    for line in lines:
        req = json.loads(line)
        sp = params(req)
        t0 = time.monotonic()
        res = llm.generate({"prompt_token_ids": req["prompt"]}, sp, use_tqdm=False)[0]
        reply = {"tokens": list(res.outputs[0].token_ids),
                 "dualpath": (res.kv_transfer_params or {}).get("dualpath"),
                 "latency_s": time.monotonic() - t0,
                 "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        print(json.dumps(reply), file=out, flush=True)


def serve_stepwise(llm, lines, out) -> None:
    """Requests added as they arrive, the engine stepped while any runs (module docstring)."""
    engine = llm.llm_engine
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: ([inbox.put(x) for x in lines], inbox.put(None)),
                     daemon=True).start()
    counts: dict[str, int] = {}

    def say(**event) -> None:
        print(json.dumps({**event, "t": time.monotonic()}), file=out, flush=True)

    while True:
        items = [inbox.get()] if not engine.has_unfinished_requests() else []
        while True:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                break
        for line in items:
            if line is None:
                return
            req = json.loads(line)
            engine.add_request(req["id"], {"prompt_token_ids": req["prompt"]}, params(req))
            counts[req["id"]] = 0
            say(id=req["id"], event="added")
        for res in engine.step() if engine.has_unfinished_requests() else ():
            n = len(res.outputs[0].token_ids)
            if n != counts.get(res.request_id):
                counts[res.request_id] = n
                say(id=res.request_id, event="tokens", n=n)
            if res.finished:
                say(id=res.request_id, event="done", tokens=list(res.outputs[0].token_ids),
                    dualpath=(res.kv_transfer_params or {}).get("dualpath"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["plain", "prefill", "decode", "example"], required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--store", default="")
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", default="")
    ap.add_argument("--engine-id", default="")
    ap.add_argument("--preset", default="smollm2-135m-f32")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--stepwise", action="store_true", help="concurrent requests (docstring)")
    a = ap.parse_args()
    # vLLM logs to stdout, in this process and the engine processes it spawns: keep the real
    # stdout for the protocol and point fd 1 at stderr (the caller's log file)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    llm = build(a)
    print("READY", file=out, flush=True)
    (serve_stepwise if a.stepwise else serve)(llm, sys.stdin, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
