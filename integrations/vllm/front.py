"""The OpenAI-compatible front: the P/D router in front of vLLM prefill and decode instances.

Per request it tokenizes the prompt, asks the dualpath scheduler for placement
(``SchedulerClient.submit`` with the token ids: the scheduler looks up the stored prefix by
their chained block keys), and on ``RequestPlaced`` drives the chosen vLLM prefill instance
(``max_tokens=1``) and decode instance with the plan in ``kv_transfer_params`` — the
DualPathConnector in each claims the request by id. Tokens stream back from the decode
instance. A re-plan (another ``RequestPlaced``, e.g. after a node died) restarts both calls on
the new pair; tokens already streamed are not sent twice (greedy output is the same).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with ``stream``),
``/v1/models``, ``/health``, ``/metrics``. With ``--api-key`` / ``--api-key-file`` every
``/v1/*`` call needs ``Authorization: Bearer KEY`` (401 ``invalid_api_key`` otherwise);
``/health`` and ``/metrics`` stay open for probes and scrapers. The extension field ``kv_loading: false`` runs a
request without dualpath on one engine (vLLM recomputes the prompt): the A/B baseline of
``dualpath demo --engine vllm``. Errors use OpenAI's shape
``{"error": {"message", "type", "code"}}``: a malformed body, an unknown model or an over-long
prompt is a 4xx before anything is submitted; a dualpath failure is a 5xx naming its code.
Runs in the vLLM venv (it needs the model's tokenizer): ``python -m integrations.vllm.front``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.errors import DualpathError
from common.protocol import FirstToken, RequestFailed, RequestFinished, RequestPlaced
from integrations.vllm import openai_api as api
from integrations.vllm.engine_calls import (Call, Decoded, EngineCallFailed, EngineCalls, Sent,
                                            sse)
from integrations.vllm.front_config import FrontConfig, parse_args, scheduler_client
from services.scheduler.client.client import failure_error, next_event
from tools.cluster.loop_watch import watching

log = structlog.get_logger(__name__)


def error_response(status: int, message: str, code: str) -> web.Response:
    return web.json_response(api.error_body(status, message, code), status=status)


async def read_body(request: web.Request) -> bytes:
    """The request body; one over the app's size limit is a 413 in OpenAI's error shape
    (aiohttp's own 413 is plain text a client cannot parse; tests/test_fuzz_front.py)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise api.HttpError(413, f"request body over the front's limit: {e.text}",
                            "body_too_large") from None


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
        self.in_flight = Gauge("dualpath_front_requests_in_flight",
                               "generation requests being answered now", registry=self.registry)


class Front:
    """The HTTP app and what it holds: scheduler client, HTTP session to vLLM, tokenizer."""

    def __init__(self, cfg: FrontConfig, tokenizer: Any) -> None:
        self.cfg, self.tok = cfg, tokenizer
        self.metrics = Metrics()
        self.sched = scheduler_client(cfg)
        self.calls = EngineCalls(cfg.engines, cfg.model_name, tokenizer, self.metrics.ttft)
        self.slots = asyncio.Semaphore(cfg.max_inflight)
        self.api_key = api.load_api_key(cfg.api_key, cfg.api_key_file)   # None: open
        self._let_finish: set[asyncio.Task] = set()     # superseded prefills run to their end

    def app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20, middlewares=[self._authorize])
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.prom)])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.calls.start(self.cfg.request_timeout_s)
        await self.sched.connect(timeout=10.0)

    async def _stop(self, app: web.Application) -> None:
        for task in list(self._let_finish):
            task.cancel()
        await self.calls.close()
        await self.sched.close()

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The API key on every ``/v1/*`` call, before its body is read or anything runs."""
        if request.path.startswith("/v1/"):
            try:
                api.check_api_key(request.headers.get("Authorization"), self.api_key)
            except api.HttpError as e:
                return error_response(e.status, str(e), e.code)
        return await handler(request)

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
        arrival = time.monotonic()                # TTFT counts from here, not from placement
        try:
            body, ids = self._parse(await read_body(request), chat)
        except api.HttpError as e:
            self.metrics.requests.labels("rejected" if e.status < 500 else "error").inc()
            return error_response(e.status, str(e), e.code)
        if self.slots.locked():
            self.metrics.requests.labels("overloaded").inc()
            return error_response(429, "front overloaded: too many requests in flight", "overloaded")
        async with self.slots:
            return await self._generate(request, Call(body, ids, chat, arrival))

    def _parse(self, raw: bytes, chat: bool) -> tuple[api.CompletionBody, list[int]]:
        body = api.parse_body(raw)
        if body.model != self.cfg.model_name:
            raise api.HttpError(404, f"model {body.model!r} not served here (serving "
                                     f"{self.cfg.model_name!r}, see /v1/models)",
                                "model_not_found")
        api.check_supported(body)
        if not 1 <= api.max_tokens(body) <= self.cfg.max_tokens:
            raise api.HttpError(400, f"max_tokens must be in [1, {self.cfg.max_tokens}]",
                                "invalid_max_tokens")
        ids = self._tokens(body, chat)
        if not all(type(t) is int for t in ids):  # our tokenizer's fault, not the caller's
            raise api.HttpError(500, f"the front's tokenization produced non-integer ids "
                                     f"({type(ids[0]).__name__}, ...)", "internal_error")
        if not 1 <= len(ids) <= self.cfg.max_prompt_tokens:
            raise api.HttpError(400, f"prompt has {len(ids)} tokens; this front takes 1 to "
                                     f"{self.cfg.max_prompt_tokens}", "prompt_too_long")
        return body, ids

    def _tokens(self, body: api.CompletionBody, chat: bool) -> list[int]:
        if chat:
            if not body.messages:
                raise api.HttpError(400, "chat completions need a non-empty 'messages'",
                                    "invalid_body")
            try:
                rendered = self.tok.apply_chat_template(body.messages, add_generation_prompt=True,
                                                        tokenize=True)
            except Exception as e:  # noqa: BLE001 -- a bad message list is the caller's error
                raise api.HttpError(400, f"bad messages: {e}", "invalid_body") from None
            return api.chat_token_ids(rendered)
        if isinstance(body.prompt, str):
            return list(self.tok(body.prompt)["input_ids"])
        if isinstance(body.prompt, list) and all(0 <= t < len(self.tok) for t in body.prompt):
            return list(body.prompt)
        raise api.HttpError(400, "'prompt' must be a string or a list of token ids in the "
                                 "vocabulary", "invalid_body")

    async def _generate(self, request: web.Request, call: Call) -> web.StreamResponse:
        out: web.StreamResponse | None = None
        if call.body.stream:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            if call.chat:                         # OpenAI opens a chat stream with the role
                await out.write(sse(api.chunk(call.rid, self.cfg.model_name, True,
                                              call.created, role=True, text="")))
        try:
            with self.metrics.in_flight.track_inprogress():
                result = (await self._run(call, out) if call.body.kv_loading
                          else await self._recompute(call, out))
        except DualpathError as e:               # dualpath (scheduler, nodes, engines) failed
            self.metrics.requests.labels("failed").inc()
            log.warning("front_request_failed", request_id=call.rid, error=str(e))
            return await self._fail(out, 503, str(e), e.code.value)
        except EngineCallFailed as e:            # a vLLM instance failed the call: a 502
            self.metrics.requests.labels("engine_failed").inc()
            log.warning("front_engine_failed", request_id=call.rid, error=str(e))
            return await self._fail(out, e.status, str(e), e.code)
        except Exception as e:  # noqa: BLE001 -- the front's own fault: a 500, not blamed on dualpath
            self.metrics.requests.labels("error").inc()
            log.exception("front_request_error", request_id=call.rid)
            return await self._fail(out, 500, f"front internal error: {e!r}", "internal_error")
        self.metrics.requests.labels("ok").inc()
        if out is None:
            return web.json_response(result)
        model, usage = self.cfg.model_name, result["usage"]
        # the closing chunk carries the ``dualpath`` object too (placement, hit, TTFT), as the
        # unstreamed body does: a streaming client (the many-agents test timing each token)
        # learns what served it without a second request
        last = api.chunk(call.rid, model, call.chat, call.created,
                         finish_reason=result["choices"][0]["finish_reason"])
        await out.write(sse({**last, "dualpath": result["dualpath"]}))
        if call.body.stream_options is not None and call.body.stream_options.include_usage:
            await out.write(sse(api.usage_chunk(call.rid, model, call.chat, call.created,
                                                usage)))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _fail(self, out: web.StreamResponse | None, status: int, message: str,
                    code: str) -> web.StreamResponse:
        if out is None:
            return error_response(status, message, code)
        await out.write(sse(api.error_body(status, message, code)))
        await out.write_eof()
        return out

    async def _run(self, call: Call, out: web.StreamResponse | None) -> dict[str, Any]:
        """Submit, follow the events and the placed pair together; the final response dict."""
        self.metrics.prompt_tokens.inc(len(call.ids))
        stream = self.sched.submit(call.rid, call.session, len(call.ids), call.max_tokens,
                                   token_ids=call.ids, deadline_s=self.cfg.request_timeout_s)
        run = PlacedRun()
        try:
            try:
                await self._follow(stream, run, call, out)
            finally:
                await stream.aclose()     # before an outcome: cancels it on the scheduler
            if run.attempt is None or run.placed is None:
                raise DualpathError(f"request {call.rid}: finished without a placement")
            decoded = await run.attempt   # an engine's failure: EngineCallFailed, a 502
        except BaseException:
            if run.attempt is not None:   # the client left or the front failed: stop it
                run.attempt.cancel()
            raise
        placed = run.placed
        self.metrics.hit_tokens.inc(placed.hit_tokens)
        return self._response(call, decoded, hit_tokens=placed.hit_tokens,
                              read_side=placed.read_side, pe_engine=placed.pe_engine,
                              de_engine=placed.de_engine, ttft_parts_s=run.ttft_parts())

    async def _follow(self, stream: Any, run: PlacedRun, call: Call,
                      out: web.StreamResponse | None) -> None:
        """The scheduler's events and the current attempt, until one decides the request.

        Neither holds the client to the request's deadline once the other has decided:
        * the attempt failed (an engine call failed): a re-plan or an outcome may still come
          within ``engine_failure_grace_s`` (a dead instance's node fails its requests and the
          scheduler re-plans them); after it the engine's failure is answered, and closing the
          stream cancels the request, so no node waits for a claim that cannot come;
        * the attempt holds vLLM's whole output: the outcome is awaited ``finish_grace_s`` (it
          comes once the turn's write-back is durable, so the session's next turn hits); after
          that, or on a failure or a re-plan meanwhile, the output is served anyway (vLLM's
          own: its loaded KV verified, or recomputed) and the request is cancelled.
        """
        sent = Sent()
        loop = asyncio.get_running_loop()
        nxt: asyncio.Task[Any] | None = None
        try:
            while True:
                if nxt is None:
                    nxt = asyncio.create_task(next_event(stream))
                waits: set[asyncio.Future[Any]] = {nxt}
                left = None
                if run.attempt is not None and not run.attempt.done():
                    waits.add(run.attempt)
                elif run.attempt is not None:
                    if run.ended_at is None:
                        run.ended_at = loop.time()
                    grace = (self.cfg.finish_grace_s if run.complete()
                             else self.cfg.engine_failure_grace_s)
                    left = max(run.ended_at + grace - loop.time(), 0.0)
                done, _ = await asyncio.wait(waits, timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:              # the grace after the attempt ended is over
                    log.warning("front_outcome_late", request_id=call.rid,
                                served=run.complete(), grace_s=grace)
                    return
                if nxt not in done:
                    continue              # the attempt ended: wait for its grace
                try:
                    ev = nxt.result()
                except DualpathError as e:   # the scheduler is lost (past its resubmits)
                    if not run.complete():
                        raise
                    log.warning("front_served_without_outcome", request_id=call.rid,
                                error=str(e))
                    return
                finally:
                    nxt = None
                if ev is None or isinstance(ev, RequestFinished):
                    return
                if isinstance(ev, RequestFailed):
                    if not run.complete():
                        raise failure_error(ev)
                    log.warning("front_served_though_failed", request_id=call.rid,
                                code=ev.code, error=ev.message)
                    return
                if isinstance(ev, FirstToken):
                    run.first_token = ev
                elif isinstance(ev, RequestPlaced):
                    if run.complete():    # a re-plan after vLLM answered: serve the answer
                        log.warning("front_served_before_replan", request_id=call.rid)
                        return
                    run.start(ev, asyncio.create_task(self._attempt(ev, call, out, sent)))
        finally:
            if nxt is not None:
                nxt.cancel()
                await asyncio.wait([nxt])

    async def _recompute(self, call: Call, out: web.StreamResponse | None) -> dict[str, Any]:
        """The A/B baseline (``kv_loading: false``): the whole request on one engine without
        ``kv_transfer_params`` — the connector stays idle and vLLM computes every prompt token
        (prefix caching off on the instances). No scheduler involved, same response shape."""
        engine = self.cfg.recompute_engine or next(iter(self.cfg.engines))
        decoded = await self.calls.relay(self.calls.url(engine), call, None, out, Sent(),
                                         call.rid)
        return self._response(call, decoded, hit_tokens=0, read_side="off",
                              pe_engine=engine, de_engine=engine, ttft_parts_s=None)

    def _response(self, call: Call, decoded: Decoded, **dualpath: Any) -> dict[str, Any]:
        """The OpenAI-shaped body, with the ``dualpath`` object (placement, token ids, TTFT)."""
        body = api.response(call.rid, self.cfg.model_name, call.chat, decoded.text,
                            decoded.finish_reason or "length", len(call.ids),
                            len(decoded.token_ids),
                            call.created, cached_tokens=dualpath["hit_tokens"])
        body["dualpath"] = {"request_id": call.rid, **dualpath, "token_ids": decoded.token_ids,
                            "ttft_s": decoded.ttft_s, "e2e_s": time.monotonic() - call.arrival}
        return body

    async def _attempt(self, p: RequestPlaced, call: Call, out: web.StreamResponse | None,
                       sent: Sent) -> Decoded:
        """Prefill (max_tokens=1) and decode on the placed pair; stream the decode's tokens.

        A prefill call that fails while the decode waits ends the attempt at once: the decode
        would wait for KV that nobody computes. Once the decode has vLLM's whole output, the
        prefill no longer matters (a failure is logged, one still running ends on its own)."""
        # the attempt scopes the engines' claims: this attempt's vLLM requests claim this
        # attempt's plan, never an earlier attempt's request still ending in vLLM
        plan = {"request_id": p.request_id, "hit_tokens": p.hit_tokens, "attempt": p.attempt}
        pe_url, de_url = self.calls.url(p.pe_engine), self.calls.url(p.de_engine)
        prefill = asyncio.create_task(self.calls.prefill(pe_url, call, plan))
        decode = asyncio.create_task(self.calls.relay(
            de_url, call, {"request_id": p.request_id, "attempt": p.attempt}, out, sent,
            p.request_id))
        try:
            await asyncio.wait([prefill, decode], return_when=asyncio.FIRST_COMPLETED)
            if not decode.done() and not prefill.cancelled() \
                    and (error := prefill.exception()) is not None:
                raise error
            return await decode
        finally:
            if not decode.done():
                decode.cancel()
                await asyncio.wait([decode])
            if not prefill.done():
                self._let_prefill_finish(prefill)
            elif not prefill.cancelled() and (error := prefill.exception()) is not None:
                # retrieved here too when the decode side failed first (else asyncio reports
                # "Task exception was never retrieved" and the prefill's answer is lost)
                log.info("front_prefill_failed", request_id=p.request_id, error=str(error))

    def _let_prefill_finish(self, prefill: asyncio.Task) -> None:
        """A prefill whose attempt ended early (re-planned, client gone) is not aborted in
        vLLM: it runs to its end (one token; bounded by the HTTP timeout). vLLM evicts a failed
        load's half-written blocks from its prefix cache only while the request is still
        running when the step's output is processed; one aborted during that forward would
        leave them cached for the next request with the prefix — the re-planned attempt
        (docs/vllm.md "A failed load"). Bounded: with ``max_inflight`` × 4 of them still
        running, a further one is aborted (logged)."""
        if len(self._let_finish) >= 4 * self.cfg.max_inflight:
            log.warning("front_prefill_aborted", waiting=len(self._let_finish),
                        reason="too many superseded prefills still running")
            prefill.cancel()
            return
        self._let_finish.add(prefill)
        prefill.add_done_callback(self._prefill_ended)

    def _prefill_ended(self, task: asyncio.Task) -> None:
        self._let_finish.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("front_superseded_prefill_failed", error=str(task.exception()))


class PlacedRun:
    """The front's current attempt at one request: its placement and the task driving it."""

    def __init__(self) -> None:
        self.placed: RequestPlaced | None = None
        self.attempt: asyncio.Task[Decoded] | None = None
        self.ended_at: float | None = None        # loop time the attempt was seen ended
        self.first_token: FirstToken | None = None  # the scheduler's TTFT breakdown

    def start(self, placed: RequestPlaced, attempt: asyncio.Task[Decoded]) -> None:
        """A (re-)placement: the earlier attempt is stopped, the new one followed."""
        if self.attempt is not None:
            self.attempt.cancel()
        self.placed, self.attempt, self.ended_at = placed, attempt, None

    def ttft_parts(self) -> dict[str, float] | None:
        """The scheduler's split of the served attempt's TTFT (paper §7: Sch./A./R./PF., from
        the submit to the PE's first-token report), or None when its event did not come."""
        ev, placed = self.first_token, self.placed
        if ev is None or placed is None or ev.attempt != placed.attempt:
            return None
        return {"sched": ev.sched_s, "alloc": ev.alloc_s, "read": ev.read_s,
                "prefill": ev.prefill_s, "total": ev.ttft_s}

    def complete(self) -> bool:
        """The attempt ended with vLLM's whole output."""
        a = self.attempt
        return a is not None and a.done() and not a.cancelled() and a.exception() is None


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
        # as every dualpath serve process (docs/deploy.md)
        with (watching(cfg.loop_stall_s, dump_to=sys.stderr.fileno()) if cfg.loop_stall_s
              else contextlib.nullcontext()):
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
