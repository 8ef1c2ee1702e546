"""``[de_loader]``: defined beside ``[pe_receiver]`` (``services.pe_receiver.config``)."""

from services.pe_receiver.config import DELoaderConfig, NodeServiceConfig

__all__ = ["DELoaderConfig", "NodeServiceConfig"]
