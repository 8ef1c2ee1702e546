"""Every decoder of bad input raises only its typed error (issue 26, item 6).

The live fuzz files (test_fuzz_frames.py, test_fuzz_messages.py, test_fuzz_engine_socket.py)
prove that services keep serving; this file proves the layer under them, without sockets and
in milliseconds per example: whatever bytes a peer sends, each decoder a service or a client
runs on them raises the one error its caller turns into a typed answer, never anything else.

Decoders: :class:`common.framing.FrameCodec` of every channel, both directions (envelope,
hello, call body, reply / event body, the tag peek), the UCX transport hello
(``common.transport.plan.decode_hello``: ``ProtocolError``) and the front's HTTP body
(``integrations.vllm.openai_api.parse_body``: ``HttpError`` 400).

Inputs: random bytes; random msgpack values; values built from each message type's own
schema (``msgspec.inspect``: right field names and types, random content), encoded and then
mutated (bytes flipped, cut, spliced); every schema value with a field nested deeper than the
recursion limit. Bugs this found (fixed; regression cases below): a field nested ~1,000 deep
in an unknown field, a tag peek or an envelope body raised RecursionError, and a KVSpec with
``num_layers = 0`` in AttachEngine raised InvalidArgument out of the decoder — both escaped
the server's ``except DecodeError`` and closed the connection without a typed answer; a
deeply nested chat ``messages`` list made the front answer 500.
"""

from __future__ import annotations

import json
import math
from typing import Any, Union

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.errors import ProtocolError
from common.framing import FrameCodec
from common.protocol import (AdminReply, AdminRequest, DataPathReply, DataPathRequest,
                             EngineReply, EngineRequest, Envelope, GatewayReply,
                             GatewayRequest, HandshakeMsg, NodeReply, RequestEvent,
                             SchedulerRequest, union_members)
from common.protocol.frontend import FrontendReply
from common.transport.plan import HELLO_BYTES, TransferHello, decode_hello
from integrations.vllm import openai_api as api

FUZZ = settings(derandomize=True, max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# what a server decodes (requests) and what a client decodes (replies, streamed events)
REQUESTS = {"scheduler": SchedulerRequest, "gateway": GatewayRequest, "admin": AdminRequest,
            "datapath": DataPathRequest, "engine": EngineRequest}
REPLIES = {"frontend": (FrontendReply, RequestEvent), "node": (NodeReply, None),
           "gateway": (GatewayReply, None), "admin": (AdminReply, None),
           "datapath": (DataPathReply, None), "engine": (EngineReply, None)}
CODECS = {**{f"server-{k}": FrameCodec(u, 1 << 30) for k, u in REQUESTS.items()},
          **{f"client-{k}": FrameCodec(r, 1 << 30, e) for k, (r, e) in REPLIES.items()}}
DEEP = 20_000          # far past the interpreter's default recursion limit (1,000)


def deep(depth: int = DEEP) -> bytes:
    """A msgpack value nested ``depth`` arrays deep (raw bytes: msgspec cannot encode it)."""
    return b"\x91" * depth + b"\xc0"


MSGPACK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=5),
    max_leaves=20)


# ------------------------------------------------------------------ schema-built values

def wire_values(t: mi.Type) -> st.SearchStrategy[Any]:
    """Plain msgpack values shaped like ``t`` (its fields, its tags, its element types),
    content random: mostly what a real peer sends, often what no constraint allows."""
    kind = type(t)
    if kind is mi.IntType:
        return st.integers(-(2**63), 2**64 - 1) | st.integers(-2, 70)
    if kind is mi.FloatType:
        return st.floats() | st.integers(-5, 5)
    if kind is mi.StrType:
        return st.text(max_size=40) | st.text("0123456789abcdef", min_size=32, max_size=32)
    if kind is mi.BytesType:
        return st.binary(max_size=40)
    if kind is mi.BoolType:
        return st.booleans()
    if kind is mi.NoneType:
        return st.none()
    if kind is mi.LiteralType:
        return st.sampled_from(t.values)
    if kind in (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType):
        item = t.item_type if hasattr(t, "item_type") else mi.AnyType()
        return st.lists(wire_values(item), max_size=6)
    if kind is mi.DictType:
        return st.dictionaries(wire_values(t.key_type), wire_values(t.value_type), max_size=4)
    if kind is mi.UnionType:
        return st.one_of(*(wire_values(m) for m in t.types))
    if kind is mi.StructType:
        return struct_values(t)
    if kind is mi.RawType or kind is mi.AnyType:
        return MSGPACK
    if kind is mi.Metadata:
        return wire_values(t.type)
    raise AssertionError(f"no strategy for {t!r}: extend wire_values")


def struct_values(t: mi.StructType) -> st.SearchStrategy[Any]:
    fields = [(f.encode_name, f.required, st.deferred(lambda f=f: wire_values(f.type)))
              for f in t.fields]
    if t.array_like:
        head = [t.tag] if t.tag is not None else []
        return st.tuples(*(s for _, _, s in fields)).map(lambda vs: head + list(vs))

    def build(draw_values: tuple[Any, ...], keep: list[bool]) -> dict[str, Any]:
        out = {name: v for (name, req, _), v, k in zip(fields, draw_values, keep, strict=True)
               if req or k}
        if t.tag is not None:
            out = {t.tag_field: t.tag, **out}
        return out
    return st.builds(build, st.tuples(*(s for _, _, s in fields)),
                     st.lists(st.booleans(), min_size=len(fields), max_size=len(fields)))


def message_values(union: Any) -> st.SearchStrategy[Any]:
    return st.one_of(*(struct_values(mi.type_info(m)) for m in union_members(union)))


def mutated(encoded: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """An encoding with bytes flipped, cut short, or a random chunk spliced in."""
    def mutate(data: bytes, ops: list[tuple[int, int, bytes]]) -> bytes:
        buf = bytearray(data)
        for kind, pos, chunk in ops:
            at = pos % (len(buf) + 1)
            if kind == 0 and buf:
                buf[at % len(buf)] ^= (chunk[:1] or b"\xff")[0] or 1
            elif kind == 1:
                del buf[at:]
            else:
                buf[at:at] = chunk
        return bytes(buf)
    ops = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.binary(max_size=8)),
                   min_size=1, max_size=4)
    return st.builds(mutate, encoded, ops)


def nested_deep(values: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """A schema value whose last field (or a new unknown one) is replaced by a deep nest."""
    def splice(value: Any) -> bytes:
        if isinstance(value, dict):
            body = msgspec.msgpack.encode({**value, "zz": None})
            return body[:-1] + deep()                    # "zz"'s value: the nest
        if isinstance(value, list) and value:
            return msgspec.msgpack.encode(value)[:-_last_len(value[-1])] + deep()
        return deep()
    return values.map(splice)


def _last_len(item: Any) -> int:
    return len(msgspec.msgpack.encode(item))


# ------------------------------------------------------------------ the property

def decodes_or_typed_error(decode: Any, data: Any, error: type[Exception]) -> None:
    """``decode(data)`` returns, or raises ``error``; anything else fails the test."""
    try:
        decode(data)
    except error:
        pass


def codec_checks(codec: FrameCodec, data: bytes) -> None:
    for fn in (codec.envelope, codec.handshake):
        decodes_or_typed_error(fn, data, msgspec.DecodeError)
    raw = msgspec.Raw(data)
    for fn in (codec.body, codec.event):
        decodes_or_typed_error(fn, raw, msgspec.DecodeError)
    assert codec.body_is_unknown(raw) in (True, False)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_random_bytes_and_msgpack_values_raise_only_decode_errors(name):
    codec = CODECS[name]

    @FUZZ
    @given(data=st.binary(max_size=300) | MSGPACK.map(msgspec.msgpack.encode))
    def check(data: bytes) -> None:
        codec_checks(codec, data)
    check()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_schema_values_mutated_or_nested_raise_only_decode_errors(name):
    codec = CODECS[name]
    union = codec_union(name)
    values = message_values(union) | message_values(Envelope) | message_values(HandshakeMsg)
    encoded = values.map(msgspec.msgpack.encode)

    @FUZZ
    @given(data=encoded | mutated(encoded) | nested_deep(values))
    def check(data: bytes) -> None:
        codec_checks(codec, data)
    check()


def codec_union(name: str) -> Any:
    """What the codec decodes call / reply bodies as (a frontend client: replies and events)."""
    side, key = name.split("-", 1)
    if side == "server":
        return REQUESTS[key]
    reply, event = REPLIES[key]
    if event is None:
        return reply
    return Union[(*union_members(reply), *union_members(event))]  # noqa: UP007 -- built at runtime


@pytest.mark.parametrize("union", [*REQUESTS.values(), *(r for r, _ in REPLIES.values())],
                         ids=lambda u: union_members(u)[0].__name__)
def test_schema_values_decode_when_well_formed(union):
    """The generator is not vacuous: values it builds decode, or fail a declared constraint
    (a ValidationError), and never raise anything else."""
    codec = FrameCodec(union, 1 << 30)
    decoded = 0

    @settings(FUZZ, max_examples=100)
    @given(value=message_values(union))
    def check(value: Any) -> None:
        nonlocal decoded
        try:
            codec.body(msgspec.Raw(msgspec.msgpack.encode(value)))
            decoded += 1
        except msgspec.ValidationError:
            pass
    check()
    assert decoded > 0, f"no generated {union} decoded: the strategy misses the schema"


# ------------------------------------------------------------------ regressions (bugs found)

@pytest.mark.parametrize("name", sorted(CODECS))
def test_regression_deep_nesting_is_a_decode_error(name):
    codec = CODECS[name]
    call = b"\x94\xa1c\x01\xcb\x3f\xf0" + b"\x00" * 6 + deep()     # Call(1, 1.0, <nest>)
    with pytest.raises(msgspec.DecodeError):
        codec.envelope(call)
    unknown_field = b"\x82\xa1t\xa1x\xa1y" + deep()                  # {"t": "x", "y": <nest>}
    assert codec.body_is_unknown(msgspec.Raw(unknown_field)) is False
    with pytest.raises(msgspec.DecodeError):
        codec.body(msgspec.Raw(unknown_field))


def test_regression_a_refused_kv_spec_is_a_decode_error():
    body = msgspec.msgpack.encode({"t": "engine.attach", "engine_id": "p0.e0", "role": "prefill",
                                   "kv_spec": {"name": "x", "num_layers": 0,
                                               "kv_bytes_per_token_per_layer": 256}})
    with pytest.raises(msgspec.ValidationError, match="num_layers must be positive"):
        CODECS["server-engine"].body(msgspec.Raw(body))


# ------------------------------------------------------------------ the UCX transport hello

HELLO_VALUES = struct_values(mi.type_info(TransferHello))


def hello_frame(body: bytes) -> np.ndarray:
    buf = np.zeros(HELLO_BYTES, dtype=np.uint8)
    body = body[:HELLO_BYTES - 2]
    buf[:2] = np.frombuffer(len(body).to_bytes(2, "little"), dtype=np.uint8)
    buf[2:2 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    return buf


@FUZZ
@given(data=st.binary(max_size=HELLO_BYTES) | mutated(HELLO_VALUES.map(msgspec.msgpack.encode))
       | HELLO_VALUES.map(lambda v: msgspec.msgpack.encode([*v, None])[:-1] + deep(1_500)))
def test_transport_hello_raises_only_protocol_errors(data):
    raw = np.frombuffer(data.ljust(HELLO_BYTES, b"\x00")[:HELLO_BYTES], dtype=np.uint8)
    decodes_or_typed_error(decode_hello, raw.copy(), ProtocolError)   # length prefix random
    decodes_or_typed_error(decode_hello, hello_frame(data), ProtocolError)


# ------------------------------------------------------------------ the front's HTTP body

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=5),
    max_leaves=20)
FIELD_VALUES = (JSON | st.integers(-(10**30), 10**30) | st.sampled_from(
    ["\ud800", "\u202e\u0000", "🙂" * 50, "", "a" * 5000, 1e308, -0.0, 2**63, 2**64, -(2**63) - 1]))
BODY_FIELDS = [f.name for f in msgspec.structs.fields(api.CompletionBody)]


def json_text(value: Any) -> bytes:
    """JSON with Python's encoder (surrogates escaped, huge ints written out)."""
    return json.dumps(value).encode()


HTTP_BODIES = st.one_of(
    st.binary(max_size=200),                                     # not JSON, not UTF-8
    JSON.map(json_text),                                         # JSON of any shape
    st.dictionaries(st.sampled_from(BODY_FIELDS), FIELD_VALUES, max_size=8)
    .map(lambda d: json_text({"model": "m", **d})),              # right names, wrong values
    mutated(st.just(json_text({"model": "m", "prompt": "hi", "max_tokens": 4}))),
    st.sampled_from(["messages", "prompt", "tools", "logit_bias", "response_format"])
    .map(lambda f: b'{"model": "m", "%s": ' % f.encode() + b"[" * 100_000 + b"]" * 100_000
         + b"}"),
)


@FUZZ
@given(raw=HTTP_BODIES)
def test_front_body_parse_raises_only_a_400(raw):
    try:
        body = api.parse_body(raw)
    except api.HttpError as e:
        assert e.status == 400 and e.code == "invalid_body", (e.status, e.code)
        return
    assert isinstance(body, api.CompletionBody)
    assert isinstance(body.model, str)
    if isinstance(body.prompt, list):
        assert all(type(t) is int for t in body.prompt)
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"):
        value = getattr(body, field)
        assert value is None or math.isfinite(value), (field, value)


def test_regression_front_deeply_nested_messages_is_a_400():
    raw = b'{"model": "m", "messages": [' + b"[" * 50_000 + b"]" * 50_000 + b"]}"
    with pytest.raises(api.HttpError) as e:
        api.parse_body(raw)
    assert (e.value.status, e.value.code) == (400, "invalid_body")
