"""A replica's ranks: the executor, each rank's runner, rank processes and their channels."""
