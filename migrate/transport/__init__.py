"""How a round's frames travel between replicas: the frame link, HTTP, Mooncake."""
