"""The serving loop: sessions, the scheduler, the paged KV cache, the engine and its thread."""
