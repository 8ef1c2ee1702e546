"""The engine API: the small async interface a prefill or decode engine embeds (docs/engine-api.md)."""
