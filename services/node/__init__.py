"""What a PE receiver and a DE loader share: the node base (``base``), its config, the
attempt driver (``driver``: one action table, task owner, wake-up and deadline), the narrow
I/O object attempts get (``io``), the gateway clients and the one hit read (``gateway``), the
actions both transfer cores emit (``actions``), ordered reports, the hop/peer-error helpers and
the KV egress arbiter. Neither node service imports the other."""
