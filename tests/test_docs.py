"""The repository documents itself: no text points at the contract file that lives outside the
repository (a user who clones it does not have it), and every relative link in README.md and
docs/*.md names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build", "dist"}
# built from pieces so this file does not match itself
OUTSIDE_CONTRACT = re.compile("shared/" + r"SPEC\.md|" + "SPEC" + r" §\s*\d")
# [text](target) and [text](target "title"); images too
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _skipped(rel: Path) -> bool:
    return any(part in SKIP_DIRS or part.startswith(".venv") or part.endswith(".egg-info") for part in rel.parts)


def repo_files() -> list[Path]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if p.is_file() and not p.is_symlink() and not _skipped(rel):
            out.append(p)
    return out


def test_no_reference_to_the_outside_contract():
    hits = []
    for p in repo_files():
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_CONTRACT.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "point at docs/ instead:\n" + "\n".join(hits)


def _links(md: Path) -> list[str]:
    text = md.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold examples, not links
    return MD_LINK.findall(text)


def test_relative_markdown_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert (ROOT / "docs" / "README.md") in pages
    broken, checked = [], 0
    for md in pages:
        for target in _links(md):
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or not parts.path:
                continue  # a web address, or an anchor in the same page
            checked += 1
            dest = (md.parent / unquote(parts.path)).resolve()
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert checked > 20, f"only {checked} relative links found: the link pattern is broken"
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_the_checks_catch_what_they_look_for(tmp_path):
    # the patterns themselves: a test that cannot fail is a defect
    assert OUTSIDE_CONTRACT.search("see ../shared" + "/SPEC.md")
    assert OUTSIDE_CONTRACT.search("the contract (" + "SPEC" + " §3)")
    assert not OUTSIDE_CONTRACT.search("docs/replica-api.md")
    page = tmp_path / "page.md"
    page.write_text('[a](x.md) [b](https://e.org/y) [c](#z) ![d](img/e.png "t")\n```\n[e](f.md)\n```\n')
    assert _links(page) == ["x.md", "https://e.org/y", "#z", "img/e.png"]


def test_environment_table_is_generated_from_the_settings():
    """docs/cli.md lists every RELAYOUT_* variable exactly as relayout.storage.settings declares it, and
    the code reads no RELAYOUT_* variable the settings do not declare."""
    import re

    from relayout.storage.settings import Settings, settings_table

    docs = (ROOT / "docs" / "cli.md").read_text()
    assert settings_table() in docs
    declared = {f"RELAYOUT_{n.upper()}" for n in Settings.model_fields}
    read = set()
    for pkg in ("engine", "migrate", "agent", "storage"):
        for f in (ROOT / pkg).rglob("*.py"):
            read |= set(re.findall(r"environ(?:\.get)?[\[(]\s*\"(RELAYOUT_[A-Z0-9_]+)", f.read_text()))
    assert not read, f"read straight from the environment, not through relayout.storage.settings: {read}"
    documented = set(re.findall(r"`(RELAYOUT_[A-Z0-9_]+)`", docs))
    assert documented <= declared | {"RELAYOUT_TOKEN"}, documented - declared
