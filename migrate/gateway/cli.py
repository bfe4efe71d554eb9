"""The gateway's flags, defined once: `relayout gateway` (agent.cli registers `gateway_command`) and
`python -m relayout.migrate.gateway.app` parse them the same way. Light on purpose: the gateway's
app is imported only when it starts."""

from __future__ import annotations

import typer
from relayout.engine.command import fail


def gateway_command(
    agent: list[str] = typer.Option([], "--agent", help="agent URL whose replicas to serve (repeatable)"),
    replica: list[str] = typer.Option([], "--replica", help="a replica URL to serve directly (repeatable)"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_key: list[str] = typer.Option([], "--api-key", help="a client API key (repeatable; default "
                                                          "RELAYOUT_API_KEYS, comma-separated; none: open)"),
) -> None:
    """The clients' OpenAI API in front of the replicas; streams survive migrations, checkpoints, failovers."""
    from relayout.migrate.gateway.app import run_gateway

    if not agent and not replica:
        fail("give at least one --agent or --replica")
    run_gateway(agent, replica, host, port, api_key)
