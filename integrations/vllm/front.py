"""The OpenAI-compatible front: the P/D router in front of vLLM prefill and decode instances.

Per request it tokenizes the prompt, asks the dualpath scheduler for placement
(``SchedulerClient.submit`` with the token ids: the scheduler looks up the stored prefix by
their chained block keys), and on ``RequestPlaced`` drives the chosen vLLM prefill instance
(``max_tokens=1``) and decode instance with the plan in ``kv_transfer_params`` — the
DualPathConnector in each claims the request by id. Tokens stream back from the decode
instance. A re-plan (another ``RequestPlaced``, e.g. after a node died) restarts both calls on
the new pair; tokens already streamed are not sent twice (greedy output is the same).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with ``stream``),
``/v1/models``, ``/health``, ``/metrics``. The extension field ``kv_loading: false`` runs a
request without dualpath on one engine (vLLM recomputes the prompt): the A/B baseline of
``dualpath demo --engine vllm``. Errors use OpenAI's shape
``{"error": {"message", "type", "code"}}``: a malformed body, an unknown model or an over-long
prompt is a 4xx before anything is submitted; a dualpath failure is a 5xx naming its code.
Runs in the vLLM venv (it needs the model's tokenizer): ``python -m integrations.vllm.front``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

import aiohttp
import msgspec
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from common.errors import DualpathError
from common.protocol import RequestFailed, RequestFinished, RequestPlaced
from services.scheduler.client.client import SchedulerClient, failure_error

log = structlog.get_logger(__name__)

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]



def chat_token_ids(rendered: Any) -> list[int]:
    """The token ids of ``apply_chat_template(tokenize=True)``: transformers 5 returns a
    mapping (``BatchEncoding``, ids under ``input_ids``) where 4.x returned the list itself —
    iterating the mapping would submit its keys as token ids."""
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    if ids and isinstance(ids[0], list):       # a batch of one conversation
        ids = ids[0]
    return [int(t) for t in ids]

class FrontConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the scheduler and the engines are, and the limits the front states."""

    model_name: str
    tokenizer: str
    scheduler_host: str
    scheduler_port: int
    engines: dict[str, str]                   # dualpath engine id -> vLLM base URL
    host: str = "127.0.0.1"
    port: int = 0
    max_prompt_tokens: PositiveInt = 2000
    max_tokens: PositiveInt = 512
    max_inflight: PositiveInt = 64
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    recompute_engine: str = ""                # kv_loading=false goes here ("" = first engine)


class CompletionBody(msgspec.Struct, forbid_unknown_fields=False):
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 16
    stream: bool = False
    temperature: float = 0.0
    session_id: str | None = None             # extension: the agent session (prefix reuse)
    kv_loading: bool = True                   # extension: false = no dualpath, vLLM recomputes
    user: str | None = None


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code}},
                             status=status)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("dualpath_front_requests", "HTTP generation requests",
                                ["status"], registry=self.registry)
        self.ttft = Histogram("dualpath_front_ttft_seconds", "time to first token",
                              registry=self.registry)
        self.prompt_tokens = Counter("dualpath_front_prompt_tokens", "prompt tokens",
                                     registry=self.registry)
        self.hit_tokens = Counter("dualpath_front_hit_tokens", "prompt tokens loaded by dualpath",
                                  registry=self.registry)


class Front:
    """The HTTP app and what it holds: scheduler client, HTTP session to vLLM, tokenizer."""

    def __init__(self, cfg: FrontConfig, tokenizer: Any) -> None:
        self.cfg, self.tok = cfg, tokenizer
        self.metrics = Metrics()
        self.sched = SchedulerClient(cfg.scheduler_host, cfg.scheduler_port, client_id="front")
        self.http: aiohttp.ClientSession | None = None
        self.slots = asyncio.Semaphore(cfg.max_inflight)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20)
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.prom)])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        self.http = aiohttp.ClientSession(timeout=timeout)
        await self.sched.connect(timeout=10.0)

    async def _stop(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()
        await self.sched.close()

    # ------------------------------------------------------------------ plain endpoints
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "owned_by": "dualpath"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "engines": sorted(self.cfg.engines)})

    async def prom(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            content_type="text/plain")

    # ------------------------------------------------------------------ generation
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body, ids = self._parse(await request.read(), chat)
        except HttpError as e:
            self.metrics.requests.labels("rejected").inc()
            return error_response(e.status, str(e), e.code)
        if self.slots.locked():
            self.metrics.requests.labels("overloaded").inc()
            return error_response(429, "front overloaded: too many requests in flight", "overloaded")
        async with self.slots:
            return await self._generate(request, body, ids, chat)

    def _parse(self, raw: bytes, chat: bool) -> tuple[CompletionBody, list[int]]:
        try:
            body = msgspec.json.decode(raw, type=CompletionBody)
        except msgspec.DecodeError as e:
            raise HttpError(400, f"malformed request body: {e}", "invalid_body") from None
        if body.model != self.cfg.model_name:
            raise HttpError(404, f"model {body.model!r} not served here (serving "
                                 f"{self.cfg.model_name!r}, see /v1/models)", "model_not_found")
        if not 1 <= body.max_tokens <= self.cfg.max_tokens:
            raise HttpError(400, f"max_tokens must be in [1, {self.cfg.max_tokens}]",
                            "invalid_max_tokens")
        ids = self._tokens(body, chat)
        if not 1 <= len(ids) <= self.cfg.max_prompt_tokens:
            raise HttpError(400, f"prompt has {len(ids)} tokens; this front takes 1 to "
                                 f"{self.cfg.max_prompt_tokens}", "prompt_too_long")
        return body, ids

    def _tokens(self, body: CompletionBody, chat: bool) -> list[int]:
        if chat:
            if not body.messages:
                raise HttpError(400, "chat completions need a non-empty 'messages'", "invalid_body")
            try:
                rendered = self.tok.apply_chat_template(body.messages, add_generation_prompt=True,
                                                        tokenize=True)
            except Exception as e:  # noqa: BLE001 -- a bad message list is the caller's error
                raise HttpError(400, f"bad messages: {e}", "invalid_body") from None
            return chat_token_ids(rendered)
        if isinstance(body.prompt, str):
            return list(self.tok(body.prompt)["input_ids"])
        if isinstance(body.prompt, list) and all(0 <= t < len(self.tok) for t in body.prompt):
            return list(body.prompt)
        raise HttpError(400, "'prompt' must be a string or a list of token ids in the vocabulary",
                        "invalid_body")

    async def _generate(self, request: web.Request, body: CompletionBody, ids: list[int],
                        chat: bool) -> web.StreamResponse:
        rid = f"front-{uuid.uuid4().hex[:16]}"
        session = body.session_id or body.user or rid
        out: web.StreamResponse | None = None
        if body.stream:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        try:
            result = (await self._run(rid, session, ids, body, out, chat) if body.kv_loading
                      else await self._recompute(rid, ids, body, out, chat))
        except DualpathError as e:
            self.metrics.requests.labels("failed").inc()
            log.warning("front_request_failed", request_id=rid, error=str(e))
            if out is None:
                return error_response(503, str(e), e.code.value if hasattr(e, "code") else "failed")
            await out.write(b"data: " + json.dumps({"error": {"message": str(e)}}).encode()
                            + b"\n\n")
            await out.write_eof()
            return out
        self.metrics.requests.labels("ok").inc()
        if out is not None:
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        return web.json_response(result)

    async def _run(self, rid: str, session: str, ids: list[int], body: CompletionBody,
                   out: web.StreamResponse | None, chat: bool) -> dict[str, Any]:
        """Submit, follow the events, drive the placed pair; the final response dict."""
        t0 = time.monotonic()
        self.metrics.prompt_tokens.inc(len(ids))
        sent: list[int] = []
        attempt: asyncio.Task[dict[str, Any]] | None = None
        placed: RequestPlaced | None = None
        async with self.sched.submit(rid, session, len(ids), body.max_tokens, token_ids=ids,
                                     deadline_s=self.cfg.request_timeout_s) as events:
            async for ev in events:
                if isinstance(ev, RequestPlaced):
                    if attempt is not None:
                        attempt.cancel()
                    placed = ev
                    attempt = asyncio.create_task(self._attempt(ev, ids, body, out, sent, chat))
                elif isinstance(ev, RequestFailed):
                    if attempt is not None:
                        attempt.cancel()
                    raise failure_error(ev)
                elif isinstance(ev, RequestFinished):
                    break
        if attempt is None or placed is None:
            raise DualpathError(f"request {rid}: finished without a placement")
        decoded = await attempt
        self.metrics.hit_tokens.inc(placed.hit_tokens)
        return self._response(rid, ids, chat, decoded, t0, hit_tokens=placed.hit_tokens,
                              read_side=placed.read_side, pe_engine=placed.pe_engine,
                              de_engine=placed.de_engine)

    async def _recompute(self, rid: str, ids: list[int], body: CompletionBody,
                         out: web.StreamResponse | None, chat: bool) -> dict[str, Any]:
        """The A/B baseline (``kv_loading: false``): the whole request on one engine without
        ``kv_transfer_params`` — the connector stays idle and vLLM computes every prompt token
        (prefix caching off on the instances). No scheduler involved, same response shape."""
        t0 = time.monotonic()
        engine = self.cfg.recompute_engine or next(iter(self.cfg.engines))
        decoded = await self._relay(self._url(engine), ids, body.max_tokens, None, out, [],
                                    rid, chat, t0)
        return self._response(rid, ids, chat, decoded, t0, hit_tokens=0, read_side="off",
                              pe_engine=engine, de_engine=engine)

    def _response(self, rid: str, ids: list[int], chat: bool, decoded: dict[str, Any],
                  t0: float, **dualpath: Any) -> dict[str, Any]:
        """The OpenAI-shaped body, with the ``dualpath`` object (placement, token ids, TTFT)."""
        toks = decoded["token_ids"]
        text = self.tok.decode(toks, skip_special_tokens=True)
        choice: dict[str, Any] = ({"message": {"role": "assistant", "content": text}} if chat
                                  else {"text": text})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "model": self.cfg.model_name,
                "choices": [{"index": 0, **choice, "finish_reason": decoded["finish_reason"]}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(toks),
                          "total_tokens": len(ids) + len(toks)},
                "dualpath": {"request_id": rid, **dualpath, "token_ids": toks,
                             "ttft_s": decoded["ttft_s"], "e2e_s": time.monotonic() - t0}}

    def _url(self, engine: str) -> str:
        try:
            return self.cfg.engines[engine]
        except KeyError:
            raise DualpathError(f"the scheduler placed on engine {engine!r}, which this front "
                                f"has no URL for (known: {sorted(self.cfg.engines)})") from None

    async def _attempt(self, p: RequestPlaced, ids: list[int], body: CompletionBody,
                       out: web.StreamResponse | None, sent: list[int], chat: bool
                       ) -> dict[str, Any]:
        """Prefill (max_tokens=1) and decode on the placed pair; stream the decode's tokens."""
        plan = {"request_id": p.request_id, "hit_tokens": p.hit_tokens}
        t0 = time.monotonic()
        prefill = asyncio.create_task(self._post(self._url(p.pe_engine), ids, 1, plan))
        try:
            decoded = await self._relay(self._url(p.de_engine), ids, body.max_tokens,
                                        {"request_id": p.request_id}, out, sent, p.request_id,
                                        chat, t0)
            await prefill
        finally:
            prefill.cancel()
        return decoded

    async def _relay(self, url: str, ids: list[int], max_tokens: int,
                     plan: dict[str, Any] | None, out: web.StreamResponse | None,
                     sent: list[int], rid: str, chat: bool, t0: float) -> dict[str, Any]:
        """Stream one vLLM completion; forward tokens not in ``sent`` yet (a re-planned
        attempt does not repeat what the client has); its tokens, finish reason and TTFT."""
        toks: list[int] = []
        finish_reason, ttft = None, None
        async for chunk in self._stream(url, ids, max_tokens, plan):
            choice = chunk["choices"][0]
            new = list(choice.get("token_ids") or [])
            if new and ttft is None:
                ttft = time.monotonic() - t0
                self.metrics.ttft.observe(ttft)
            toks.extend(new)
            finish_reason = choice.get("finish_reason") or finish_reason
            if out is not None and len(toks) > len(sent):
                fresh = toks[len(sent):]
                sent.extend(fresh)
                await out.write(self._sse(rid, fresh, chat))
        return {"token_ids": toks, "finish_reason": finish_reason or "length", "ttft_s": ttft}

    def _sse(self, rid: str, toks: list[int], chat: bool) -> bytes:
        text = self.tok.decode(toks, skip_special_tokens=True)
        delta = {"delta": {"content": text}} if chat else {"text": text}
        chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                 "model": self.cfg.model_name,
                 "choices": [{"index": 0, **delta, "token_ids": toks}]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def _vllm_body(self, ids: list[int], max_tokens: int, plan: dict[str, Any] | None,
                   stream: bool) -> dict[str, Any]:
        body = {"model": self.cfg.tokenizer, "prompt": ids, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": stream, "return_token_ids": True}
        return body if plan is None else {**body, "kv_transfer_params": {"dualpath": plan}}

    async def _post(self, url: str, ids: list[int], max_tokens: int,
                    plan: dict[str, Any]) -> dict[str, Any]:
        assert self.http is not None
        async with self.http.post(f"{url}/v1/completions",
                                  json=self._vllm_body(ids, max_tokens, plan, False)) as r:
            data = await r.json()
            if r.status != 200:
                raise DualpathError(f"vLLM at {url} answered {r.status}: {data}")
            return data

    async def _stream(self, url: str, ids: list[int], max_tokens: int,
                      plan: dict[str, Any] | None) -> AsyncIterator[dict[str, Any]]:
        assert self.http is not None
        async with self.http.post(f"{url}/v1/completions",
                                  json=self._vllm_body(ids, max_tokens, plan, True)) as r:
            if r.status != 200:
                raise DualpathError(f"vLLM at {url} answered {r.status}: {await r.text()}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                yield json.loads(line[6:])


def parse_args(argv: list[str] | None = None) -> FrontConfig:
    ap = argparse.ArgumentParser(description="dualpath's OpenAI-compatible front for vLLM")
    ap.add_argument("--model-name", required=True, help="the name clients ask for")
    ap.add_argument("--tokenizer", required=True, help="model directory (vLLM's --model)")
    ap.add_argument("--scheduler", required=True, help="HOST:PORT of the dualpath scheduler")
    ap.add_argument("--engine", action="append", default=[], metavar="ID=URL",
                    help="a dualpath engine id and its vLLM base URL (repeat)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-prompt-tokens", type=int, default=2000)
    ap.add_argument("--request-timeout-s", type=float, default=300.0,
                    help="each request's dualpath deadline (and the HTTP calls' to vLLM)")
    ap.add_argument("--recompute-engine", default="",
                    help="engine id for requests with kv_loading=false (default: the first)")
    a = ap.parse_args(argv)
    host, _, port = a.scheduler.rpartition(":")
    engines = dict(e.split("=", 1) for e in a.engine)
    if a.recompute_engine and a.recompute_engine not in engines:
        ap.error(f"--recompute-engine {a.recompute_engine!r} is not one of --engine "
                 f"{sorted(engines)}")
    return msgspec.convert({"model_name": a.model_name, "tokenizer": a.tokenizer,
                            "scheduler_host": host, "scheduler_port": int(port),
                            "engines": engines, "host": a.host, "port": a.port,
                            "max_prompt_tokens": a.max_prompt_tokens,
                            "request_timeout_s": a.request_timeout_s,
                            "recompute_engine": a.recompute_engine}, FrontConfig)


class FrontStartError(Exception):
    """The front could not start (its scheduler is dead or is not a scheduler)."""


async def serve(cfg: FrontConfig) -> None:
    from transformers import AutoTokenizer

    front = Front(cfg, AutoTokenizer.from_pretrained(cfg.tokenizer))
    runner = web.AppRunner(front.app())
    try:
        await runner.setup()                  # on_startup: connects to the scheduler (10 s)
    except (DualpathError, OSError) as e:
        await front.sched.close()
        raise FrontStartError(f"front: the dualpath scheduler at {cfg.scheduler_host}:"
                              f"{cfg.scheduler_port} did not answer as a scheduler ({e}); "
                              "nothing was served") from None
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"READY http://{cfg.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(cfg))
    except FrontStartError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
