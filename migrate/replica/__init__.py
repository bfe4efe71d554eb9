"""A whole replica process: its routes, its command line, and process management."""
