"""Sessions into and out of a replica: snapshots, KV imports and exports, placement on arrival."""
