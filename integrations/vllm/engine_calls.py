"""The front's HTTP calls to its vLLM instances: one attempt's prefill and streamed decode.

Per attempt the front sends the placed prefill instance the prompt with ``max_tokens=1`` and
the placed decode instance the whole request, streamed, each with the plan in
``kv_transfer_params`` (the DualPathConnector in each claims the request by id). Every way
such a call can fail — the instance unreachable, an HTTP error status, an error chunk in the
stream, a stream that ends before vLLM's ``[DONE]``, the HTTP timeout — raises one typed
:class:`EngineCallFailed` naming the instance: the front answers it with a 502 (the engine's
fault, not the scheduler's, not the front's own), and stops waiting for a dualpath outcome
that can no longer come (docs/vllm.md, "The front").
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Histogram

from common.errors import DualpathError
from integrations.vllm import openai_api as api


class EngineCallFailed(api.HttpError):
    """A call to a vLLM instance failed: answered with a 502 ``engine_failed``."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(502, f"vLLM at {url}: {what}", "engine_failed")


class Call:
    """One client request as the front serves it: its body, prompt ids and arrival time."""

    def __init__(self, body: api.CompletionBody, ids: list[int], chat: bool,
                 arrival: float) -> None:
        self.body, self.ids, self.chat, self.arrival = body, ids, chat, arrival
        self.rid = f"front-{uuid.uuid4().hex[:16]}"
        self.session = body.session_id or body.user or self.rid
        self.max_tokens = api.max_tokens(body)
        self.created = int(time.time())


class Sent:
    """The token ids already streamed to the client (kept across re-planned attempts)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []


class Decoded:
    """What one vLLM completion produced (whole: its stream reached ``[DONE]``)."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.ttft_s: float | None = None


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class EngineCalls:
    """The HTTP session to the vLLM instances and the calls an attempt makes on it."""

    def __init__(self, engines: dict[str, str], model_name: str, tokenizer: Any,
                 ttft: Histogram) -> None:
        self.engines, self.model_name, self.tok, self.ttft = engines, model_name, tokenizer, ttft
        self.http: aiohttp.ClientSession | None = None
        self._models: dict[str, str] = {}     # vLLM base URL -> the model name it serves

    def start(self, timeout_s: float) -> None:
        # idle connections to vLLM are dropped here before vLLM (uvicorn, keep-alive 5 s) drops
        # them: with aiohttp's 15 s, a request sent on a connection the server was closing
        # failed "Server disconnected" (a CI run: a turn after a service restart's idle gap)
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(keepalive_timeout=4.0))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.close()

    def url(self, engine: str) -> str:
        try:
            return self.engines[engine]
        except KeyError:
            raise DualpathError(f"the scheduler placed on engine {engine!r}, which this front "
                                f"has no URL for (known: {sorted(self.engines)})") from None

    async def relay(self, url: str, call: Call, plan: dict[str, Any] | None,
                    out: web.StreamResponse | None, sent: Sent, rid: str) -> Decoded:
        """Stream one vLLM completion; forward what the client does not have yet (a re-planned
        attempt does not repeat it). The text is vLLM's own incremental detokenization (a
        multi-byte character split over tokens arrives whole; stop strings are cut there)."""
        got = Decoded()
        async for piece in self._stream(url, call, plan):
            choice = piece["choices"][0]
            new = list(choice.get("token_ids") or [])
            if new and got.ttft_s is None:
                got.ttft_s = time.monotonic() - call.arrival
                if not sent.token_ids:
                    self.ttft.observe(got.ttft_s)
            before = len(got.token_ids)
            got.token_ids.extend(new)
            got.text += choice.get("text") or ""
            got.finish_reason = choice.get("finish_reason") or got.finish_reason
            if out is not None and len(got.token_ids) > len(sent.token_ids):
                fresh = got.token_ids[len(sent.token_ids):]
                # a chunk wholly new: vLLM's text; one straddling what a re-planned attempt
                # already streamed: only its unsent tokens, decoded here
                text = ((choice.get("text") or "") if before >= len(sent.token_ids) else
                        self.tok.decode(fresh, skip_special_tokens=True))
                sent.token_ids.extend(fresh)
                await out.write(sse(api.chunk(rid, self.model_name, call.chat,
                                              call.created, text=text, token_ids=fresh)))
        got.finish_reason = got.finish_reason or "length"
        return got

    async def prefill(self, url: str, call: Call, plan: dict[str, Any]) -> dict[str, Any]:
        """The prefill instance's call (``max_tokens=1``): its KV is what the call is for."""
        assert self.http is not None
        body = await self._body(url, call, 1, plan, False)
        try:
            async with self.http.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise EngineCallFailed(url, f"answered {r.status}: {await r.text()}")
                return dict(await r.json())
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise EngineCallFailed(url, f"the prefill call failed: {e!r}") from None

    async def _stream(self, url: str, call: Call, plan: dict[str, Any] | None
                      ) -> AsyncIterator[dict[str, Any]]:
        """vLLM's stream chunks; raises EngineCallFailed unless the stream ends in [DONE]."""
        assert self.http is not None
        body = await self._body(url, call, call.max_tokens, plan, True)
        try:
            async with self.http.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise EngineCallFailed(url, f"answered {r.status}: {await r.text()}")
                async for raw in r.content:
                    line = raw.strip()
                    if line == b"data: [DONE]":
                        return
                    if not line.startswith(b"data: "):
                        continue
                    piece = json.loads(line[6:])
                    if "error" in piece or piece.get("object") == "error":   # vLLM's shapes
                        raise EngineCallFailed(url, f"the stream failed: {piece}")
                    if piece.get("choices"):
                        yield piece
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise EngineCallFailed(url, f"the decode stream failed: {e!r}") from None
        raise EngineCallFailed(url, "the decode stream ended before its [DONE]")

    async def _upstream_model(self, url: str) -> str:
        """The name vLLM serves under (its ``/v1/models``), asked once per instance: the
        front's own ``--model-name`` is what clients say, not what vLLM was started with."""
        name = self._models.get(url)
        if name is None:
            assert self.http is not None
            try:
                async with self.http.get(f"{url}/v1/models") as r:
                    if r.status != 200:
                        raise EngineCallFailed(url, f"/v1/models answered {r.status}")
                    name = str((await r.json())["data"][0]["id"])
            except (aiohttp.ClientError, TimeoutError, ValueError, LookupError) as e:
                raise EngineCallFailed(url, f"/v1/models failed: {e!r}") from None
            self._models[url] = name
        return name

    async def _body(self, url: str, call: Call, max_tokens: int,
                    plan: dict[str, Any] | None, stream: bool) -> dict[str, Any]:
        body = {"model": await self._upstream_model(url), "prompt": call.ids,
                "max_tokens": max_tokens, **api.sampling_fields(call.body), "stream": stream,
                "return_token_ids": True}
        return body if plan is None else {**body, "kv_transfer_params": {"dualpath": plan}}
