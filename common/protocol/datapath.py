"""Data path channel: PE receiver ↔ DE loader, where each layer's KV goes."""

from __future__ import annotations

from typing import Union

import msgspec

from common.protocol.base import ErrorReply, Message, ReadSide
from common.protocol.connection import GetStats, GetStatsReply, Ping, Pong
from common.protocol.node import Endpoint


# =========================================================================== data path
# PE receiver ↔ DE loader (services/pe_receiver, services/de_loader; docs/datapath.md). The DE
# loader serves this channel; the PE receiver of a plan is the client. KV bytes move over UCX
# (``common.transport``) into receives posted in advance; these messages only say where.
# A request region is laid out ``[L, prompt_tokens, B]`` on both sides, so one layer of one
# request is one contiguous run: each ``LayerSlots`` is normally a single ``(offset, nbytes)``.
#
#   PE → DE  PrepareDecode     DE allocates; PE/none path: posts receives for every layer
#                              ``[l, 0:prompt]`` (reply.forward); DE path: starts its read.
#   PE → DE  PullLayers        (DE path) PE posted receives for layers' ``[l, 0:hit]``; the DE
#                              sends them once its read is done and posts receives for the
#                              return of ``[l, hit:prompt]`` (reply.returns, reply.hit_tokens).
#   PE → DE  PrefillDone       all layers sent; DE answers once every receive completed.
#   PE → DE  AbortDecode       the PE gave up on the attempt: the DE frees it.

class LayerSlots(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One layer's transfer: the receiver's ``transfer_id`` and its arena ``slots``."""

    layer: int
    transfer_id: int
    slots: list[tuple[int, int]]


class PrepareDecode(Message, tag="dp.prepare", frozen=True):
    """Reserve the DE region of one request attempt and set up its read side.

    ``hit_tokens``: the planned hit (a multiple of the block size, covered by ``hit_keys``).
    ``ucx_host``/``ucx_port``: the PE receiver's page transport. ``read_gateway``: where the
    DE reads the hit on the DE path (None: the loader's own node gateway). ``split_tokens``
    (read side "split" only): the DE reads and streams only the hit's leading ``split_tokens``;
    the PE reads the rest and forwards it with the new tokens.
    """

    request_id: str
    attempt: int
    session_id: str
    de_engine: str
    pe_node: str
    read_side: ReadSide
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    hit_keys: list[str]
    new_keys: list[str]
    ucx_host: str
    ucx_port: int
    tail_token_ids: list[int] | None = None
    read_gateway: Endpoint | None = None
    deadline_s: float | None = None
    split_tokens: int = 0


class PrepareDecodeReply(Message, tag="dp.prepare.reply", frozen=True):
    """``forward``: per layer, where the PE sends ``[l, 0:prompt]`` (PE/none path; [] on DE)."""

    request_id: str
    attempt: int
    forward: list[LayerSlots]


class PullLayers(Message, tag="dp.pull", frozen=True):
    """DE path: send these layers' hit KV ``[l, 0:hit_tokens]`` into the PE's posted slots.

    Consecutive entries with the same ``transfer_id`` are one transfer (the layers' bytes in
    the listed order): one posted receive and one send for several layers.
    """

    request_id: str
    attempt: int
    layers: list[LayerSlots]


class PullLayersReply(Message, tag="dp.pull.reply", frozen=True):
    """The layers were sent. ``hit_tokens``: the usable hit after the DE's read (a missing
    block shortens it; the PE computes the rest); ``returns``: where the PE sends each pulled
    layer's ``[l, hit_tokens:prompt]`` back."""

    request_id: str
    attempt: int
    hit_tokens: int
    returns: list[LayerSlots]


class PrefillDone(Message, tag="dp.prefill_done", frozen=True):
    """Every layer was sent. ``hit_tokens``: the hit the PE used (its read on the PE path)."""

    request_id: str
    attempt: int
    hit_tokens: int
    first_token_id: int | None = None


class PrefillDoneReply(Message, tag="dp.prefill_done.reply", frozen=True):
    """The DE holds the full prompt KV of the attempt."""

    request_id: str
    attempt: int


class AbortDecode(Message, tag="dp.abort", frozen=True):
    request_id: str
    attempt: int
    reason: str = ""


class AbortDecodeReply(Message, tag="dp.abort.reply", frozen=True):
    request_id: str
    aborted: bool


DataPathRequest = Union[PrepareDecode, PullLayers, PrefillDone, AbortDecode, Ping, GetStats]
DataPathReply = Union[PrepareDecodeReply, PullLayersReply, PrefillDoneReply, AbortDecodeReply,
                      Pong, GetStatsReply, ErrorReply]
