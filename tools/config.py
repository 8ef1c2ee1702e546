"""Root of a whole host config file: every service section plus the tools' own (``[engine_sim]``).

``dualpath serve`` and the launcher load files with this class; the services accept it because
it extends ``services.config.ServicesConfig``.
"""

from __future__ import annotations

import msgspec

from services.config import ServicesConfig
from tools.engine_sim.config import EngineSimConfig


class DualpathConfig(ServicesConfig):
    """A host's config file: services' sections plus the engine emulator's."""

    engine_sim: EngineSimConfig = msgspec.field(default_factory=EngineSimConfig)
