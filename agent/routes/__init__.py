"""The node agent's REST routes: replicas, checkpoints, operations, protection, drain, fleet."""
