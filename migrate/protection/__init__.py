"""Protection: continuous replication of a replica's sessions to a standby."""
