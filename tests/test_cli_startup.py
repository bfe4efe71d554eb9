"""The commands that only speak REST to an agent (`relayout --help`, `status`, `checkpoint`, `migrate`,
`drain`) start without importing torch or the other heavy libraries: each is run in a fresh Python
process, through the same typer app as the `relayout` script, and that process reports which of them
it imported. No wall-clock limit is asserted (machines differ); the import set is what makes them slow."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "safetensors", "vllm")

# Runs the `relayout` entry point (relayout.agent.cli:app) with the given argv, then prints one JSON
# line: the exit code and which HEAVY top-level packages are in sys.modules.
_PROBE = """
import json, sys
argv, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["relayout", *argv]
from relayout.agent.cli import app
try:
    app()
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(heavy))
print("\\nPROBE " + json.dumps({"code": code, "loaded": loaded}), flush=True)
"""


def _probe(*argv: str) -> tuple[dict, subprocess.CompletedProcess]:
    p = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv), json.dumps(HEAVY)],
                       capture_output=True, text=True, timeout=120, env={**_env(), "COLUMNS": "200"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
    assert lines, f"the probe did not finish (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return json.loads(lines[-1][len("PROBE "):]), p


def _env() -> dict[str, str]:
    # no token file or agent list from the caller's environment changes what the commands do
    return {k: v for k, v in os.environ.items() if k not in ("RELAYOUT_TOKEN", "RELAYOUT_AGENTS",
                                                                 "RELAYOUT_DRAIN_TARGET")}


def _dead_url() -> str:
    """A local URL nothing listens on: a port the kernel just gave out, closed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["checkpoint", "--help"],
                                  ["migrate", "--help"], ["drain", "--help"]], ids=" ".join)
def test_help_does_not_import_torch(argv):
    res, p = _probe(*argv)
    assert res["code"] == 0, p.stderr[-2000:]
    assert "Usage" in p.stdout
    assert res["loaded"] == [], f"`relayout {' '.join(argv)}` imported {res['loaded']}"


def test_status_of_an_unreachable_agent_fails_cleanly_without_torch():
    url = _dead_url()
    res, p = _probe("status", "--agent", url)
    assert res["code"] == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stdout + p.stderr
    node_lines = [ln for ln in p.stdout.splitlines() if url in ln]
    assert len(node_lines) == 1 and "unreachable" in node_lines[0], p.stdout
    assert res["loaded"] == []


@pytest.mark.parametrize("argv", [["checkpoint", "r1"], ["migrate", "r1", "--layout", "attn_dp=1"],
                                  ["drain", "--target-agent", "http://127.0.0.1:1"]],
                         ids=lambda a: a[0])
def test_agent_commands_reach_the_http_call_without_torch(argv):
    """Up to the first request (refused: nothing listens), these commands need no torch either."""
    url = _dead_url()
    res, p = _probe(*argv, "--agent", url)
    assert res["code"] == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Traceback" not in p.stdout + p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot reach agent {url}"), p.stderr
    assert res["loaded"] == []


def test_storage_package_names_still_resolve():
    """relayout.storage loads its public names on first use; every name in __all__ is there."""
    import relayout.storage as storage
    from relayout.storage.checkpoint import CheckpointReader
    from relayout.storage.stores import open_store

    for name in storage.__all__:
        assert getattr(storage, name) is not None, name
    assert storage.CheckpointReader is CheckpointReader and storage.open_store is open_store
    assert set(storage.__all__) <= set(dir(storage))
    with pytest.raises(AttributeError):
        storage.no_such_name  # noqa: B018
