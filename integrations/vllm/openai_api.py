"""The OpenAI request and response shapes of the front (``integrations.vllm.front``).

What a client sends is decoded once into :class:`CompletionBody`; every sampling field is
either forwarded to vLLM (:func:`sampling_fields`) or refused with a typed 400
(:func:`check_supported`) — never silently dropped. Responses and stream chunks follow OpenAI's
completions / chat completions shapes, plus a ``dualpath`` object (placement, token ids, TTFT)
on the final body. Pure functions: the HTTP app lives in ``front.py``.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec


class HttpError(Exception):
    """A request the front answers with ``status`` and an OpenAI-shaped error ``code``."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def load_api_key(key: str, key_file: str) -> bytes | None:
    """The front's API key from ``--api-key`` or ``--api-key-file`` (None: no key, open).

    Both set, an unreadable or an empty file is a ValueError naming the flag: a key the
    operator meant to set never silently turns into an open front.
    """
    if key and key_file:
        raise ValueError("set only one of --api-key and --api-key-file")
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {key_file!r} cannot be read: {e.strerror}") from e
        if not key:
            raise ValueError(f"--api-key-file {key_file!r} is empty")
    return key.encode() if key else None


def check_api_key(authorization: str | None, key: bytes | None) -> None:
    """Raise a 401 (OpenAI's ``invalid_api_key``) unless ``Authorization: Bearer <key>``.

    Compared in constant time (``hmac.compare_digest``) so response timing tells a guesser
    nothing about how much of the key matched; the message never echoes what was sent.
    """
    if key is None:
        return
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
        return
    what = "no API key" if not authorization else "an incorrect API key"
    raise HttpError(401, f"{what} provided; send 'Authorization: Bearer <key>' with the "
                         "front's --api-key", "invalid_api_key")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class CompletionBody(msgspec.Struct, forbid_unknown_fields=False):
    """``/v1/completions`` and ``/v1/chat/completions`` bodies (unknown fields are ignored, as
    OpenAI's own server does for forward compatibility; every *known* field is honoured or
    refused)."""

    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None      # chat's newer name for max_tokens
    stream: bool = False
    stream_options: StreamOptions | None = None
    # sampling, forwarded to vLLM as given
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # refused unless default (see UNSUPPORTED)
    n: int | None = None
    best_of: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    # extensions
    session_id: str | None = None             # the agent session (prefix reuse)
    kv_loading: bool = True                   # false = no dualpath, vLLM recomputes the prompt
    user: str | None = None


def parse_body(raw: bytes) -> CompletionBody:
    """Decode a request body; anything that is not one is a 400 ``invalid_body``.

    RecursionError too: a JSON value nested deeper than the recursion limit inside a field
    typed ``Any`` (``messages``, ``tools``) gets past msgspec's typed checks, and without
    this it was a 500 (tests/test_fuzz_decoders.py).
    """
    try:
        return msgspec.json.decode(raw, type=CompletionBody)
    except msgspec.DecodeError as e:
        raise HttpError(400, f"malformed request body: {e}", "invalid_body") from None
    except RecursionError:
        raise HttpError(400, "malformed request body: nested too deeply",
                        "invalid_body") from None


DEFAULT_MAX_TOKENS = 16
# forwarded to vLLM's sampling parameters unchanged when set
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos")
# field -> the values that mean "not used"; anything else is a 400 naming the field: one
# choice per request (the P/D pair serves one sequence), no logprobs/echo/suffix/bias/tools
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []),
}


def check_supported(body: CompletionBody) -> None:
    """Refuse (400 ``unsupported_parameter``) a field this front cannot honour."""
    for name, defaults in UNSUPPORTED.items():
        value = getattr(body, name)
        if not any(value == d and type(value) is type(d) for d in defaults):
            raise HttpError(400, f"{name}={value!r} is not supported by the dualpath front "
                                 f"(supported: one choice, no logprobs/echo/suffix/logit_bias/"
                                 f"tools)", "unsupported_parameter")
    fmt = (body.response_format or {}).get("type", "text")
    if fmt != "text":
        raise HttpError(400, f"response_format {fmt!r} is not supported (only 'text')",
                        "unsupported_parameter")


def max_tokens(body: CompletionBody) -> int:
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens


def sampling_fields(body: CompletionBody) -> dict[str, Any]:
    """The sampling fields the client set, for vLLM's completion body. Greedy when none:
    temperature 0 (the front's outputs are compared with plain vLLM's at temperature 0)."""
    out = {k: getattr(body, k) for k in SAMPLING if getattr(body, k) is not None}
    out.setdefault("temperature", 0.0)
    return out


def chat_token_ids(rendered: Any) -> list[int]:
    """The token ids of ``apply_chat_template(tokenize=True)``: transformers 5 returns a
    mapping (``BatchEncoding``, ids under ``input_ids``) where 4.x returned the list itself —
    iterating the mapping would submit its keys as token ids."""
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    if ids and isinstance(ids[0], list):       # a batch of one conversation
        ids = ids[0]
    return list(ids)


def usage(prompt_tokens: int, completion_tokens: int,
          cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` (``prompt_tokens_details``, as OpenAI reports
    prompt caching): the prompt tokens dualpath loaded instead of computing — what clients
    such as AIPerf read as the prompt-cache hit."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def response(rid: str, model: str, chat: bool, text: str, finish_reason: str,
             prompt_tokens: int, completion_tokens: int, created: int,
             cached_tokens: int | None = None) -> dict[str, Any]:
    """The whole (non-streamed) completion body."""
    choice: dict[str, Any] = ({"message": {"role": "assistant", "content": text}} if chat
                              else {"text": text, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model,
            "choices": [{"index": 0, **choice, "finish_reason": finish_reason}],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chunk(rid: str, model: str, chat: bool, created: int, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None,
          token_ids: list[int] | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta, the chat role opener, or the closing finish reason."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None}
    choice["finish_reason"] = finish_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, created: int,
                usage_object: dict[str, Any]) -> dict[str, Any]:
    """``stream_options.include_usage``: the last chunk, no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage_object}


def error_body(status: int, message: str, code: str) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": code}}
