"""The clients' OpenAI front door: streams kept whole across moves and failovers."""
