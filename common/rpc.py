"""Control-plane RPC of dualpath: the one import services and frontends use.

msgspec msgpack over asyncio TCP with length-prefixed frames (``common.framing``); the server
lives in ``common.rpc_server`` (what it accepts in a hello: ``common.rpc_hello``), the client
in ``common.rpc_client``. Both run on uvloop and on
the plain asyncio loop (``common.service.run`` picks one).

Server::

    async def ping(msg: Ping, ctx: CallContext) -> Pong: ...
    async def watch(msg: Watch, ctx: CallContext):       # server push
        yield Event(...)
    server = RpcServer(cfg.rpc, service="scheduler", node_id="n0",
                       handlers={Ping: ping, Watch: watch}, request_type=SchedulerRequest)
    await server.start(port=0)

Client::

    async with RpcClient(cfg.rpc, host, server.port, role="frontend", node_id="fe0",
                         reply_type=SchedulerReply) as client:
        pong = await client.call(Ping(), timeout=1.0)
        async for event in client.stream(Watch(...)):
            ...
"""

from common.rpc_client import RpcClient, RpcStream
from common.rpc_server import CallContext, RpcServer, ServerConnection, check_handler_coverage

__all__ = [
    "CallContext", "RpcClient", "RpcServer", "RpcStream", "ServerConnection",
    "check_handler_coverage",
]
