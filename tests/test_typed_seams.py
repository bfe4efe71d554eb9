"""The engine seams are Protocols a type checker holds both engines to: mypy reads
tests/typed_seams.py, where `LLMEngine` and `VllmEngine` must be `SessionEngine`s and `EngineThreadOps`
and `VllmOps` must be `EngineOps` (pyproject's [tool.mypy]). Also shown to fail: an engine's
operations class is not a session engine, and a Protocol member no class has is reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEAMS = ROOT / "tests" / "typed_seams.py"
pytest.importorskip("mypy", reason="mypy is in the test extras (pip install -e '.[test]')")


def mypy(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess:
    # relayout is installed as a mapping of the repository's folders, which mypy cannot follow: give it
    # a tree where relayout/engine etc. are those folders
    tree = tmp_path / "tree" / "relayout"
    tree.mkdir(parents=True, exist_ok=True)
    for folder in ("engine", "storage", "migrate", "agent", "bench"):
        link = tree / folder
        if not link.exists():
            link.symlink_to(ROOT / folder, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(tree.parent)}
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--no-incremental", "--cache-dir", str(tmp_path / "cache"), *map(str, files)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_both_engines_fit_the_seams(tmp_path):
    r = mypy(tmp_path, SEAMS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no issues found in 1 source file" in r.stdout


def test_the_check_fails_on_a_class_that_does_not_fit(tmp_path):
    wrong = tmp_path / "wrong_seams.py"
    wrong.write_text(SEAMS.read_text() + "\n\ndef not_an_engine(o: EngineThreadOps) -> SessionEngine:\n    return o\n"
                     "\n\nclass Partial:\n    places_on_arrival = True\n\n\n"
                     "def partial_ops(o: Partial) -> EngineOps:\n    return o\n")
    r = mypy(tmp_path, wrong)
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'got "EngineThreadOps", expected "SessionEngine"' in r.stdout
    assert 'got "Partial", expected "EngineOps"' in r.stdout
