"""The wheel holds the relayout packages and nothing else (no tests/, no deploy/, no top-level
`engine` or `agent` next to other distributions), and declares the `relayout` command and the
`bench` plugin command; the container images copy every package they build from.

The wheel is built from a copy of the source tree (setuptools writes build/ and *.egg-info next to
the sources, and a stale build/ could leak removed modules into the wheel)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "storage", "migrate", "agent", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(ROOT, src, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__",
                                                  ".pytest_cache", ".ruff_cache", ".hypothesis", "data"))
    assert (src / "tests").is_dir() and (src / "deploy").is_dir()  # present, so leaving them out is a choice
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (whl,) = out.glob("relayout-*.whl")
    with zipfile.ZipFile(whl) as z:
        yield z


def test_everything_is_under_relayout(wheel):
    names = wheel.namelist()
    stray = [n for n in names if not n.startswith("relayout/")
             and not (n.startswith("relayout-") and n.split("/")[0].endswith(".dist-info"))]
    assert not stray, stray
    assert "relayout/__init__.py" not in names  # a namespace package: other distributions may add to it


def test_every_package_and_module_is_in(wheel):
    names = set(wheel.namelist())
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).glob("*.py")):
            assert f"relayout/{pkg}/{path.name}" in names, f"{pkg}/{path.name} missing from the wheel"
    for left_out in ("tests/", "deploy/"):
        assert not [n for n in names if left_out in n], left_out


def test_entry_points(wheel):
    (ep_file,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    eps = configparser.ConfigParser()
    eps.read_string(wheel.read(ep_file).decode())
    assert eps["console_scripts"]["relayout"] == "relayout.agent.cli:app"
    assert eps["relayout.commands"]["bench"] == "relayout.bench.cli:bench_app"


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_images_build_from_every_package(flavour):
    # the images run `pip install .` on a copy of only the folders they name: one left out fails the build
    docker = ROOT / "deploy" / "docker"
    dockerfile = (docker / f"Dockerfile.{flavour}").read_text()
    ignore = (docker / f"Dockerfile.{flavour}.dockerignore").read_text().split()
    for pkg in PACKAGES:
        assert f"COPY {pkg} ./{pkg}" in dockerfile.splitlines(), (flavour, pkg)
        assert f"!{pkg}/**" in ignore, (flavour, pkg)
