"""A decode instance's request: the prompt KV the DE loader assembled goes into vLLM's paged
cache before decoding; full blocks of generated tokens go back through the DE loader.

vLLM loads all prompt tokens but the last and recomputes that one (it needs its logits to
sample; vLLM's own P/D connectors do the same), so the decode instance's first token is the
greedy continuation of exactly the KV dualpath delivered. Only blocks whose KV exists are
written back — after ``n`` generated tokens that is prompt tail + ``output[:-1]`` — the rule
the scheduler and the DE loader assume (docs/engine-api.md).

The prompt KV is loaded off vLLM's step (an asynchronous load, docs/vllm.md): ``loaded`` hands
the node's pages back as soon as it is in the paged cache (its answer confirms the node still
held them while they were copied, so the load waits for it); the request's first forward then
produces the first token, its second forward the second (``second_token``, TTST).

What ``after_step`` tells the node inside vLLM's step (the second token; the pages of a request
whose whole prompt vLLM held in its own prefix cache) needs no answer before the step goes on:
it is *posted* (``post``: the worker half's one notice thread, so a request's notices reach the
node in order) and ``finish`` waits for them. Sent inline, every such round trip held every
running request of the instance for as long as the node took to answer — up to 100 ms
measured with four agent sessions at once, more when the node is busy with another request's
KV (tests/vllm_agents.py, docs/vllm.md "Many agents at once").
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import structlog

from services.engine_api.blocking import SyncDecodeRequest

log = structlog.get_logger(__name__)

# fill(start_token, page [L, block_tokens, B]) copies those tokens' KV out of the paged cache
FillBlock = Callable[[int, np.ndarray], None]
# post(notice) runs ``notice`` off the step, in the order posted; its future ends with it
Post = Callable[[Callable[[], None]], "Future[None]"]


def inline(notice: Callable[[], None]) -> Future[None]:
    """A poster that runs the notice at once (no notice thread: tests, tools)."""
    done: Future[None] = Future()
    notice()
    done.set_result(None)
    return done


class DecodeSession:
    """One claimed ``SyncDecodeRequest`` seen through the connector's session calls."""

    def __init__(self, req: SyncDecodeRequest, token_ids: list[int],
                 post: Post = inline) -> None:
        self._req, self._ids, self._post = req, token_ids, post
        self._took = self._second = False
        self._forwards = 0
        self._told: Future[None] | None = None      # the last notice posted

    @property
    def info(self) -> Any:
        """The request's ``PromptInfo`` (its read side is what the hit counters label)."""
        return self._req.info

    @property
    def hit_tokens(self) -> int:
        return len(self._ids) - 1

    @property
    def prompt_tokens(self) -> int:
        return len(self._ids)

    def layer(self, layer: int, timeout_s: float) -> Any:
        return self._req.layer(layer)

    def loaded(self) -> None:
        """The prompt KV is in vLLM's paged cache: the node may take its pages back."""
        if not self._took:
            self._req.took_kv()
            self._took = True

    def after_step(self) -> None:
        """End of a forward of this request, in vLLM's step: never waits for the node. The
        first forward of a request that had no load (vLLM held its whole prompt) gives the
        node's pages back; the second forward produced the second token. Both are posted."""
        if not self._took:
            self._took = True
            self._tell(self._req.took_kv)
        self._forwards += 1
        if self._forwards == 2 and not self._second:
            self._second = True
            self._tell(self._req.second_token)

    def _tell(self, notice: Callable[[], None]) -> None:
        def send() -> None:
            try:
                notice()
            except Exception as e:  # noqa: BLE001 -- the KV is in vLLM already; finish reports
                log.warning("dualpath_decode_report_failed", request_id=getattr(self._req, "request_id", ""),
                            error=str(e))
        self._told = self._post(send)

    def _settle(self) -> None:
        """Wait for the notices posted so far (they go out before what follows them)."""
        if self._told is not None:
            self._told.result()

    def finish(self, output_ids: list[int], fill: FillBlock) -> None:
        """Write back every full block whose KV exists, then finish with the output ids
        (after the notices posted for this request: the node sees them in order)."""
        self._settle()
        if not self._took:
            self._req.took_kv()
            self._took = True
        seq = self._ids + output_ids
        bt = self._req.info.block_tokens
        for index in range(len(self._ids) // bt, (len(seq) - 1) // bt):
            blk = self._req.new_block(seq[index * bt:(index + 1) * bt])
            fill(index * bt, blk.view)
            self._req.put_block(blk)
        self._req.finish(output_ids)

    def fail(self, reason: str) -> None:
        self._req.fail(reason)
