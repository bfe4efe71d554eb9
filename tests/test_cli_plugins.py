"""`relayout` adds the typer apps registered under the `relayout.commands` entry point group as
sub-commands, by entry point, without importing them itself; a plugin that fails to import is
reported and left out. Checked with a throwaway distribution on PYTHONPATH, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _dist(root: Path, entry_points: str, modules: dict[str, str]) -> str:
    info = root / "relayout_plugin_demo-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: relayout-plugin-demo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[relayout.commands]\n" + entry_points)
    for name, text in modules.items():
        (root / name).write_text(text)
    return str(root)


def _cli(path: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "relayout.agent.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_entry_point_plugins_become_sub_commands(tmp_path):
    path = _dist(tmp_path, "hello = hello_plugin:app\nbroken = no_such_module_xyz:app\n", {
        "hello_plugin.py": "import typer\napp = typer.Typer()\n\n"
                           "@app.command()\ndef greet(name: str) -> None:\n    print(f'hello {name}')\n\n"
                           "@app.command()\ndef other() -> None:\n    pass\n",
    })
    p = _cli(path, "hello", "greet", "world")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "hello world"
    assert "plugin command 'broken'" in p.stderr and "no_such_module_xyz" in p.stderr
    p = _cli(path, "--help")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "hello" in p.stdout and "bench" in p.stdout and "broken" not in p.stdout


def test_cli_prints_caller_text_and_extras_literally():
    """Errors echo what the caller typed, and help names extras, as text, not as rich markup: a
    `[/x]` in an argument would otherwise crash the error path, and `relayout[mooncake]` lose its extra."""
    from relayout.agent.cli import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["bench", "migration", "--hosts", "[/bold]odd[x]"])
    assert r.exit_code == 2, r.output
    assert "not '[/bold]odd[x]'" in " ".join(r.output.split())
    r = CliRunner().invoke(app, ["bench", "migration", "--help"], terminal_width=200)
    assert "relayout[mooncake]" in r.output
