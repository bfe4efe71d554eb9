"""The live-migration protocol: its states, the migrator, each replica's transfers."""
