"""Adapters that embed dualpath in third-party inference engines (the top layer: nothing else
in the repo imports them; each imports its engine's packages only inside itself)."""
