"""The UCX page transport (see :mod:`common.transport.page_transport`)."""

from common.transport.page_transport import PageTransport, Peer, ReceiveHandle

__all__ = ["PageTransport", "Peer", "ReceiveHandle"]
