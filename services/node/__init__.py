"""What a PE receiver and a DE loader share: the node base, its config, ordered reports, the
hop/peer-error helpers and the KV egress arbiter. Neither node service imports the other."""
