"""Stock vLLM as a replica's engine: its server, relayout's KV connector, the session surface."""
