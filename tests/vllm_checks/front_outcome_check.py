"""The front when its engine calls and dualpath's outcome disagree (aiohttp: the vLLM venv).

The front's real aiohttp app and its real HTTP calls, against stand-ins on both sides: a
scripted scheduler (events pushed by the scenario and by the stand-in engines as they are
called) and stand-in vLLM instances on 127.0.0.1 (port 0) that answer, fail with a 500, are
not there at all, wait until the client leaves (a decode waiting for KV), cut their stream
before ``[DONE]`` or send vLLM's error chunk. Per scenario one request through the front, with
a client timeout far below the request's deadline: a scenario that hangs is reported as such.
Prints one ``RESULT {json}`` line: per scenario the status, error code, output token ids,
whether the front closed the scheduler's stream before an outcome (cancelling the request),
and which stand-in calls the client's leaving aborted.

    .venv-vllm/bin/python tests/vllm_checks/front_outcome_check.py outcome
"""

import asyncio
import json
import sys
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.errors import Unavailable
from common.protocol import FirstToken, RequestFailed, RequestFinished, RequestPlaced
from integrations.vllm.front import Front, FrontConfig

TOKENS = [11, 12, 13]
CLIENT_TIMEOUT_S = 20.0       # far below the request's deadline (120 s): past it, it hung


class Tokenizer:
    def __len__(self) -> int:
        return 1000

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)


class Stream:
    """One request's scripted event stream, as ``SchedulerClient.submit`` returns it."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.events: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)
        self.final_seen = False
        self.cancelled: bool | None = None      # closed before a final event

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> Any:
        ev = await self.events.get()
        if ev is None:
            raise StopAsyncIteration
        if isinstance(ev, Exception):             # the scheduler lost, past its resubmits
            raise ev
        self.final_seen = self.final_seen or isinstance(ev, (RequestFinished, RequestFailed))
        return ev

    async def aclose(self) -> None:
        if self.cancelled is None:
            self.cancelled = not self.final_seen


class Scheduler:
    """Hands out one scripted stream; its first event places the request on ``pair``."""

    def __init__(self, pair: tuple[str, str]) -> None:
        self.pair = pair
        self.stream: Stream | None = None

    async def connect(self, timeout: float) -> None:
        return None

    async def close(self) -> None:
        return None

    def submit(self, rid: str, *args: Any, **kw: Any) -> Stream:
        self.stream = Stream(rid)
        self.stream.events.put_nowait(placed(rid, *self.pair))
        return self.stream


def placed(rid: str, pe: str, de: str, attempt: int = 0) -> RequestPlaced:
    return RequestPlaced(rid, pe, "n-" + pe, de, "n-" + de, "pe", 0, attempt)


def first_token(attempt: int) -> Any:
    """The scheduler's TTFT breakdown of ``attempt`` (Sch. 0.1, A. 0.2, R. 0.3, PF. 0.4 s)."""
    return lambda rid: FirstToken(rid, 1.0, 0.1, 0.2, 0.3, 0.4, attempt)


def finished(rid: str) -> RequestFinished:
    return RequestFinished(rid, len(TOKENS), 0.1, None, 0.01, 0.2, 0)


class Engines:
    """Stand-in vLLM instances, one behaviour each; ``after`` maps (engine, call) to the
    events the scheduler sends once that call was answered."""

    BEHAVIOURS = ("ok", "fail", "hang", "errchunk", "cut")

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.after: dict[tuple[str, str], list[Any]] = {}
        self.aborted: list[str] = []
        self.servers: dict[str, TestServer] = {}
        self.running = 0                         # calls being answered now
        self.idle = asyncio.Event()
        self.idle.set()

    async def start(self) -> dict[str, str]:
        urls = {}
        for b in self.BEHAVIOURS:
            app = web.Application()
            app.add_routes([web.get("/v1/models", self._models),
                            web.post("/v1/completions", self._handler(b))])
            # a client that leaves cancels its handler (vLLM aborts such a request)
            server = TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True)
            await server.start_server()
            self.servers[b] = server
            urls[b] = str(server.make_url("")).rstrip("/")
        closed = TestServer(web.Application(), host="127.0.0.1", port=0)
        await closed.start_server()
        urls["down"] = str(closed.make_url("")).rstrip("/")
        await closed.close()                     # nothing listens there any more
        return urls

    async def close(self) -> None:
        for server in self.servers.values():
            await server.close()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "served-model"}]})

    def _handler(self, behaviour: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            call = "decode" if body["stream"] else "prefill"
            self.running += 1
            self.idle.clear()
            try:
                return await self._answer(behaviour, call, request, body)
            except asyncio.CancelledError:
                self.aborted.append(f"{behaviour}:{call}")
                raise
            finally:
                self.running -= 1
                if not self.running:
                    self.idle.set()
                self.then(behaviour, call)
        return handle

    def then(self, *when: str) -> None:
        stream = self.sched.stream
        for ev in self.after.pop(when, []):
            assert stream is not None
            stream.events.put_nowait(ev(stream.rid) if callable(ev) else ev)

    async def _answer(self, behaviour: str, call: str, request: web.Request,
                      body: dict) -> web.StreamResponse:
        if behaviour == "fail":
            return web.Response(status=500, text="engine exploded")
        if behaviour == "hang":
            await asyncio.Event().wait()         # until the client leaves
        if call == "prefill":
            return web.json_response({"choices": [{"text": " t11", "token_ids": [11],
                                                   "finish_reason": "length"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, tok in enumerate(TOKENS):
            last = i == len(TOKENS) - 1
            await out.write(b"data: " + json.dumps({"choices": [{
                "text": f" t{tok}", "token_ids": [tok],
                "finish_reason": "length" if last else None}]}).encode() + b"\n\n")
            if behaviour == "errchunk":
                await out.write(b'data: {"error": {"message": "engine core died"}}\n\n')
                break
            if behaviour == "cut":
                break
        if behaviour != "cut":
            await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


SCENARIOS: dict[str, dict[str, Any]] = {
    # an engine call fails and no re-plan comes: a 502 at once, the request cancelled
    "decode_500": {"pair": ("ok", "fail")},
    "decode_unreachable": {"pair": ("ok", "down")},
    "decode_error_chunk": {"pair": ("ok", "errchunk")},
    "decode_cut_before_done": {"pair": ("ok", "cut")},
    "prefill_500_while_decode_waits": {"pair": ("fail", "hang")},
    "stream_decode_500": {"pair": ("ok", "fail"), "stream": True},
    # an engine call fails, then the scheduler re-plans: the new pair serves it
    "replan_after_engine_failure": {
        "pair": ("ok", "fail"),
        "after": {("ok", "prefill"): [first_token(0)],     # the failed attempt's: not served
                  ("fail", "decode"): [lambda rid: placed(rid, "ok", "ok", 1)],
                  ("ok", "decode"): [finished]}},
    # vLLM's whole output, then: the outcome / nothing / a failure / a re-plan
    # (events sent once the front's attempt ended: "attempt", "done")
    "output_then_finished": {"pair": ("ok", "ok"),
                             "after": {("ok", "prefill"): [first_token(0)],
                                       ("attempt", "done"): [finished]}},
    "output_then_no_outcome": {"pair": ("ok", "ok")},
    "stream_output_then_no_outcome": {"pair": ("ok", "ok"), "stream": True},
    "output_then_failed": {
        "pair": ("ok", "ok"),
        "after": {("attempt", "done"): [lambda rid: RequestFailed(rid, "UNAVAILABLE", "gone")]}},
    "output_then_scheduler_lost": {
        "pair": ("ok", "ok"),
        "after": {("attempt", "done"): [Unavailable("no scheduler took the request back")]}},
    "output_then_replan": {
        "pair": ("ok", "ok"),
        "after": {("attempt", "done"): [lambda rid: placed(rid, "ok", "fail", 1)]}},
    # dualpath fails while the decode waits for KV: the scheduler's typed 503
    "scheduler_fails_first": {
        "pair": ("ok", "hang"),
        "after": {("ok", "prefill"): [lambda rid: RequestFailed(rid, "UNAVAILABLE", "no DE")]}},
}


async def run(name: str, spec: dict[str, Any], urls: dict[str, str]) -> dict[str, Any]:
    sched = Scheduler(spec["pair"])
    engines = Engines(sched)
    urls.update(await engines.start())
    cfg = FrontConfig(model_name="m", tokenizer="t", scheduler_host="127.0.0.1",
                      scheduler_port=1, engines=dict(urls), request_timeout_s=120.0,
                      engine_failure_grace_s=0.5, finish_grace_s=1.0)
    front = Front(cfg, Tokenizer())
    front.sched = sched
    attempt = front._attempt

    async def spied(*args: Any) -> Any:
        # once the attempt's task is done (not merely returning), as a real outcome could
        asyncio.current_task().add_done_callback(lambda _: engines.then("attempt", "done"))
        return await attempt(*args)
    front._attempt = spied
    engines.after = dict(spec.get("after", {}))
    stream = spec.get("stream", False)
    out: dict[str, Any] = {}
    async with TestClient(TestServer(front.app(), host="127.0.0.1", port=0)) as http:
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT_S):
                r = await http.post("/v1/completions", json={
                    "model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream})
                text = await r.text()
            out["status"] = r.status
            if stream:
                events = [json.loads(line[6:]) for line in text.splitlines()
                          if line.startswith("data: {")]
                errors = [e["error"] for e in events if "error" in e]
                out["code"] = errors[0]["code"] if errors else None
                out["token_ids"] = [t for e in events for c in e.get("choices", [])
                                    for t in c.get("token_ids") or []]
                out["done"] = "data: [DONE]" in text
            else:
                body = json.loads(text)
                out["code"] = body.get("error", {}).get("code")
                out["token_ids"] = body.get("dualpath", {}).get("token_ids")
                out["de_engine"] = body.get("dualpath", {}).get("de_engine")
                out["ttft_parts"] = body.get("dualpath", {}).get("ttft_parts_s")
        except TimeoutError:
            out["status"] = "hung"
    try:                                          # the calls the front left have ended
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            await engines.idle.wait()
    except TimeoutError:
        out["engine_calls_left_running"] = engines.running
    out["cancelled"] = None if sched.stream is None else sched.stream.cancelled
    out["aborted"] = sorted(engines.aborted)
    await engines.close()
    for b in Engines.BEHAVIOURS:
        urls.pop(b, None)
    return out


async def main() -> None:
    result = {}
    for name, spec in SCENARIOS.items():
        result[name] = await run(name, spec, {})
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    assert sys.argv[1:] == ["outcome"], sys.argv
    asyncio.run(main())
