"""One rank of a replica whose driver runs on another host: `python -m relayout.engine.ranks.rank`
(the `relayout rank` command). Ranks are the engine's own processes, so their entry point is
the engine's: nothing above it is imported.

torchrun-style environment: RANK (this rank), WORLD_SIZE (checked against the driver's layout),
LOCAL_RANK (which GPU of this host), MASTER_ADDR/MASTER_PORT (the driver's rank endpoint), and
RELAYOUT_TOKEN when the driver has one."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import typer
from relayout.engine.command import fail, run_as_main
from relayout.storage.settings import settings


class RankConfigError(ValueError):
    """The environment or flags do not say which rank this is or where its driver is."""


def rank_env(env: Mapping[str, str], driver: str | None) -> tuple[int, int | None, int | None, str]:
    """(rank, world size, local rank, driver HOST:PORT) from the torchrun-style environment."""
    try:
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else None
        local = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None
    except KeyError:
        raise RankConfigError("RANK is not set (torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)") from None
    except ValueError as e:
        raise RankConfigError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {e}") from None
    if driver is None:
        if not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
            raise RankConfigError("give --driver HOST:PORT or set MASTER_ADDR and MASTER_PORT")
        driver = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return rank, world, local, driver


def run_rank(model: str, driver: str | None, threads: int | None, log=print) -> int:
    """Join the driver and serve as one rank until it shuts the replica down; the exit code.
    Raises RankConfigError, RankJoinError or ModelNotFoundError (callers turn them into exit codes)."""
    from relayout.engine.model.weights import resolve_model
    from relayout.engine.ranks.rank_process import rank_main

    rank, world, local, driver = rank_env(os.environ, driver)
    model_dir = resolve_model(model)
    log(f"relayout rank {rank} joining {driver}")
    return rank_main(rank, driver, str(model_dir), settings().token, threads, local, world)


def rank_command(
    model: str = typer.Option("builtin:tiny", "--model", "-m", help="the same model as the driver's, on this host"),
    driver: str = typer.Option(None, "--driver", help="the driver's rank endpoint HOST:PORT "
                                                      "(default: $MASTER_ADDR:$MASTER_PORT)"),
    threads: int = typer.Option(None, "--threads", help="CPU threads for this rank (default: torch's)"),
) -> None:
    """Run one rank of a replica whose driver (`relayout serve --local-ranks ...`) is on another host.

    torchrun-style environment: RANK (this rank), WORLD_SIZE (checked against the driver's layout),
    LOCAL_RANK (which GPU of this host), MASTER_ADDR/MASTER_PORT (the driver's --rank-endpoint), and
    RELAYOUT_TOKEN when the driver has one. Exits 0 when the driver shuts the replica down."""
    from relayout.engine.model.weights import ModelNotFoundError
    from relayout.engine.ranks.rank_process import RankJoinError

    try:
        code = run_rank(model, driver, threads, log=lambda m: print(m, file=sys.stderr, flush=True))
    except RankConfigError as e:
        fail(str(e))
    except (RankJoinError, ModelNotFoundError, ValueError) as e:
        fail(str(e), code=1)
    raise typer.Exit(code)


def main(argv: list[str] | None = None) -> None:
    """`python -m relayout.engine.ranks.rank`: the flags of `relayout rank`."""
    run_as_main(rank_command, "python -m relayout.engine.ranks.rank", argv)


if __name__ == "__main__":
    main()
