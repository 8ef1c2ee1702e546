"""The wire schema: every message round-trips through its channel decoders; bad bodies fail."""

from __future__ import annotations

import typing

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import protocol
from common.framing import FrameCodec
from common.kv import KVSpec
from common.protocol import (
    AdminRequest, Call, Envelope, ErrorReply, GetStats, HandshakeMsg, Message, Ping, Reply,
    union_members,
)

def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


# Only the shared schema (the ``common.protocol`` package: one module per channel): test
# modules define messages of their own.
MESSAGES = sorted((c for c in _subclasses(Message)
                   if c.__module__.startswith(protocol.__name__ + ".")),
                  key=lambda c: c.__name__)
UNIONS = {name: u for name, u in vars(protocol).items()
          if typing.get_origin(u) is typing.Union
          and all(isinstance(m, type) and issubclass(m, Message) for m in typing.get_args(u))}

_I64 = st.integers(-(2**63), 2**64 - 1)


def _strategy(t: mi.Type) -> st.SearchStrategy:
    """A hypothesis strategy for a msgspec type (from ``msgspec.inspect``)."""
    simple = {
        mi.IntType: _I64, mi.FloatType: st.floats(allow_nan=False), mi.StrType: st.text(),
        mi.BytesType: st.binary(max_size=64), mi.BoolType: st.booleans(),
        mi.NoneType: st.none(),
        mi.RawType: st.builds(lambda v: msgspec.Raw(msgspec.msgpack.encode(v)),
                              st.one_of(st.integers(0, 9), st.text(max_size=8))),
    }
    if type(t) in simple:
        return simple[type(t)]
    match t:
        case mi.UnionType():
            return st.one_of(*(_strategy(x) for x in t.types))
        case mi.ListType() | mi.VarTupleType():
            items = st.lists(_strategy(t.item_type), max_size=5)
            return items.map(tuple) if isinstance(t, mi.VarTupleType) else items
        case mi.TupleType():
            return st.tuples(*(_strategy(x) for x in t.item_types))
        case mi.DictType():
            return st.dictionaries(_strategy(t.key_type), _strategy(t.value_type), max_size=5)
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.EnumType():
            return st.sampled_from(list(t.cls))
        case mi.StructType() if t.cls is KVSpec:      # validated on construction: sizes > 0
            return st.builds(KVSpec, st.text(max_size=16), st.integers(1, 1024),
                             st.integers(1, 1 << 20), st.integers(1, 1024), st.text(max_size=8))
        case mi.StructType():
            return st.builds(t.cls, **{f.name: _strategy(f.type) for f in t.fields})
    raise NotImplementedError(f"no strategy for {t!r}; extend tests/test_protocol.py")


def _unions_of(cls: type) -> list[typing.Any]:
    return [u for u in UNIONS.values() if cls in union_members(u)]


def test_schema_is_enumerated():
    assert len(MESSAGES) >= 15
    assert {"Envelope", "HandshakeMsg", "AdminRequest", "AdminReply"} <= set(UNIONS)


def test_every_message_is_in_the_one_namespace():
    """The channel modules are an implementation detail: ``common.protocol`` exports them all."""
    assert all(getattr(protocol, c.__name__, None) is c for c in MESSAGES)


def test_tags_are_explicit_and_unique():
    tags = [c.__struct_config__.tag for c in MESSAGES]
    assert all(isinstance(t, str) and t for t in tags)
    assert len(tags) == len(set(tags)), "two messages share a tag"


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_every_message(cls, data):
    msg = data.draw(_strategy(mi.type_info(cls)))
    wire = msgspec.msgpack.encode(msg)
    decoders = [msgspec.msgpack.Decoder(cls)] + [msgspec.msgpack.Decoder(u)
                                                 for u in _unions_of(cls)]
    for dec in decoders:
        back = dec.decode(wire)
        assert type(back) is cls
        assert msgspec.msgpack.encode(back) == wire   # byte-equal (floats, Raw included)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_messages_are_frozen(cls):
    msg = _minimal(cls)
    fields = msgspec.structs.fields(cls)
    if fields:
        with pytest.raises(AttributeError):
            setattr(msg, fields[0].name, getattr(msg, fields[0].name))
    assert cls.__struct_config__.frozen and cls.__struct_config__.forbid_unknown_fields


def _minimal(cls: type) -> Message:
    """The simplest instance of ``cls``, built field by field without hypothesis."""
    zero = {mi.IntType: 0, mi.FloatType: 0.0, mi.StrType: "", mi.BytesType: b"",
            mi.BoolType: False, mi.RawType: msgspec.Raw(b"\xc0")}
    kwargs = {}
    for f in mi.type_info(cls).fields:
        if f.required:
            kwargs[f.name] = zero[type(f.type)] if type(f.type) in zero else _empty(f.type)
    return cls(**kwargs)


def _empty(t: mi.Type) -> typing.Any:
    match t:
        case mi.ListType():
            return []
        case mi.DictType():
            return {}
        case mi.StructType() if t.cls is KVSpec:
            return KVSpec("", 1, 1)
        case mi.StructType():
            return _minimal(t.cls)
        case mi.UnionType():
            return None
        case mi.LiteralType():
            return t.values[0]
    raise NotImplementedError(repr(t))


def test_envelope_body_travels_raw_and_decodes_with_the_channel_union():
    enc = msgspec.msgpack.Encoder()
    call = Call(7, 1.5, msgspec.Raw(enc.encode(Ping(b"x"))))
    env = msgspec.msgpack.Decoder(Envelope).decode(enc.encode(call))
    assert type(env) is Call and env.id == 7 and env.deadline_s == 1.5
    assert msgspec.msgpack.Decoder(AdminRequest).decode(env.body) == Ping(b"x")


def test_unknown_tag_is_rejected():
    wire = msgspec.msgpack.encode({"t": "no.such.message"})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(AdminRequest).decode(wire)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(Envelope).decode(msgspec.msgpack.encode(["z", 1]))


def test_wrong_field_type_is_rejected():
    wire = msgspec.msgpack.encode({"t": "ping", "payload": 123})
    with pytest.raises(msgspec.ValidationError, match="payload"):
        msgspec.msgpack.Decoder(AdminRequest).decode(wire)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(HandshakeMsg).decode(
            msgspec.msgpack.encode({"t": "hello", "version": "1", "role": "r", "node_id": "n"}))


def test_unknown_field_is_rejected():
    wire = msgspec.msgpack.encode({"t": "stats.get", "surprise": 1})
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        msgspec.msgpack.Decoder(AdminRequest).decode(wire)


def test_codec_tells_unknown_tags_from_malformed_bodies():
    codec = FrameCodec(AdminRequest, 1 << 20)
    raw = msgspec.Raw
    assert codec.body_is_unknown(raw(msgspec.msgpack.encode({"t": "nope"})))
    assert codec.body_is_unknown(raw(msgspec.msgpack.encode({"payload": b""})))
    assert not codec.body_is_unknown(raw(msgspec.msgpack.encode({"t": "ping", "payload": 1})))
    assert not codec.body_is_unknown(raw(msgspec.msgpack.encode(5)))
    assert codec.body(raw(msgspec.msgpack.encode(GetStats()))) == GetStats()


def test_error_reply_and_reply_compose():
    enc = msgspec.msgpack.Encoder()
    err = ErrorReply("OVERLOADED", "busy", True, 0.25)
    wire = enc.encode(Reply(3, msgspec.Raw(enc.encode(err))))
    env = msgspec.msgpack.Decoder(Envelope).decode(wire)
    assert msgspec.msgpack.Decoder(protocol.AdminReply).decode(env.body) == err
