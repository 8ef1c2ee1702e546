"""A node's storage-gateway clients and the one hit read both node services use.

The PE receiver (PE path) and the DE loader (DE path) read a request's hit Full Blocks the same
way: the gateway a plan names (or the node's own), the hit's leading keys, scattered per layer
into the request region ``[l, 64j:64(j+1)]`` (docs/datapath.md). :meth:`NodeGateways.read_hit`
is that read; the clients are cached per gateway address and closed with the node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from common.auth import load_secret
from common.buffers import host_copies, is_device_array
from common.config import RpcConfig
from common.errors import DualpathError
from common.faults import failpoint
from common.kv import KVSpec
from common.protocol import Endpoint
from common.transport import PageTransport
from storage_gateway.client import GatewayClient

from services.node.errors import with_hop

log = structlog.get_logger(__name__)


class NodeGateways:
    """Clients of the gateways a node reads from and writes to (one per address)."""

    def __init__(self, rpc: RpcConfig, transport: PageTransport, arena: Any, spec: KVSpec, *,
                 node_id: str, role: str, local: tuple[str, int] | None,
                 on_local_read_q: Callable[[int], None] | None = None) -> None:
        self._rpc, self._transport, self._arena, self._spec = rpc, transport, arena, spec
        self._node_id, self._role, self._local = node_id, role, local
        self._clients: dict[tuple[str, int], GatewayClient] = {}
        # told the local gateway's read queue as each of its read replies states it
        self._on_local_read_q = on_local_read_q

    def client(self, endpoint: Endpoint | None) -> GatewayClient | None:
        """A client of ``endpoint``'s gateway (None: this node's configured one, if any)."""
        if endpoint is not None:
            addr, ucx = (endpoint.control_host, endpoint.control_port), \
                (endpoint.ucx_host, endpoint.ucx_port)
        elif self._local is not None:
            addr, ucx = self._local, None
        else:
            return None
        client = self._clients.get(addr)
        if client is None:
            client = GatewayClient.connect(self._rpc, addr[0], addr[1], self._transport,
                                           self._arena, self._spec, node_id=self._node_id,
                                           role=self._role, auth_secret=load_secret(self._rpc))
            if ucx is not None:
                client._gateway_ucx = ucx
            self._clients[addr] = client
        return client

    def local(self) -> GatewayClient | None:
        """This node's own gateway (write-backs, the read-queue watch), if configured."""
        return self.client(None)

    async def read_hit(self, endpoint: Endpoint | None, request_id: str, keys: Sequence[str],
                       region: Any, budget_s: float, batch_bytes: int, *, fault: str,
                       first_block: int = 0, **log_fields: Any) -> tuple[int, int] | None:
        """Read the Full Blocks ``keys`` (the hit's, from its block ``first_block``: 0 but on
        a split read's PE part) into ``region``'s blocks ``first_block..+len(keys)``,
        layer-major; returns the leading blocks of ``keys`` the gateway held and the bytes it
        read (None: no gateway to read from). ``fault`` names the failpoint before the read;
        errors carry the hop ``gateway``."""
        client = self.client(endpoint)
        if client is None:
            log.warning("no_gateway_for_read", request_id=request_id, **log_fields)
            return None
        dests = [region.block_dest(first_block + j) for j in range(len(keys))]
        try:
            failpoint(fault)
            reply = await client.read_blocks(request_id, keys, dests, budget_s, batch_bytes,
                                             layer_major=True)
        except DualpathError as e:
            raise with_hop(e, "gateway") from None
        local = self._clients.get(self._local) if self._local is not None else None
        if self._on_local_read_q is not None and client is local:
            # The reply's read queue was sampled after this read left it. Telemetry and replies
            # share one connection, in order, so no sample older than this one arrives after
            # it: taking it now keeps a sample taken mid-read (this read still counted) from
            # riding on the node's FetchWork after the read is done (docs/datapath.md).
            self._on_local_read_q(reply.read_q_tokens)
        return reply.prefix_blocks, reply.nbytes

    async def host_payloads(self, payloads: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """A write-back's ``payloads`` (per block, its views) in host memory. The gateway takes
        host arrays and a pool on the GPU hands out device views, so those leave the GPU here:
        one D2H copy each into page-locked memory, in a worker thread (the event loop never
        waits on the GPU; ``common.buffers.host_copies``). Host views pass as they are.
        ``InternalError`` (a ``DualpathError``: the write-back fails, counted) on a failed
        copy."""
        flat = [v for p in payloads for v in p]
        if not any(is_device_array(v) for v in flat):
            return [list(p) for p in payloads]
        copies = iter(await asyncio.to_thread(host_copies, flat))
        return [[next(copies) for _ in p] for p in payloads]

    async def write_batch(self, per: int, timeout_s: float) -> int:
        """Blocks per WriteBlocks: ``per``, capped by what the local gateway states one write
        may carry (``GatewayClient.max_write_blocks``, cached per connection by the client;
        ``write_blocks`` splits under the same limits whatever it is given)."""
        client = self.local()
        if client is None:
            return per
        try:
            return max(1, min(per, await client.max_write_blocks(timeout_s)))
        except DualpathError:
            return per                         # the write itself asks again (and splits)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
