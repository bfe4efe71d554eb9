"""Commands that talk to agents over REST: up, demo, status."""
