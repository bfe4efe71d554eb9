"""The node agent's own state: its registry, replicas' devices, metrics, and what callers may send."""
