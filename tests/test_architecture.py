"""The source tree's architecture, checked by reading it (no imports are run).

Every .py under engine/, storage/, migrate/, agent/ and bench/ is parsed with `ast`; its imports are
every `import x` / `from x import y` (also those inside functions and `if TYPE_CHECKING:`) and every
`importlib.import_module("...")` with a literal name. Checked:
- layering: agent -> migrate -> engine -> storage, bench on top; nothing imports upward;
- within a layer, the subsystems (its subpackages, and the modules at its top) import only those
  SUBSYSTEMS allows, and that table has no cycle: each concern lives in one folder and leans on
  the ones below it;
- no folder holds more than MAX_MODULES modules at its top; every package is in pyproject's list;
- no product function (engine, storage, migrate, agent) over MAX_FUNCTION_LINES lines;
- no import cycle among the modules, counting load-time imports only.
The walker is also run on small synthetic trees, so each check is shown to fail when it should.
"""

from __future__ import annotations

import ast
import graphlib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "relayout"
# Lowest layer first: a package may import its own modules and those of lower layers only.
LAYERS = ("storage", "engine", "migrate", "agent", "bench")
PRODUCT = ("storage", "engine", "migrate", "agent")  # bench is tooling: layered, not held to the rest
MAX_MODULES = 15  # .py files at a folder's top, __init__ included
MAX_FUNCTION_LINES = 80
# Which subsystem of a layer may import which other of the same layer (beside itself): a subsystem
# is a subpackage (engine.model) or a module at the layer's top (engine.web). Lower layers are
# always allowed (the layering above); a new subsystem must be added here to exist.
SUBSYSTEMS: dict[str, set[str]] = {
    # storage: the format's values, then where they are kept, then checkpoints and streams of both
    "storage": set(),  # __init__: lazy names only (importlib, not a literal import)
    "storage.errors": set(),
    "storage.settings": set(),
    "storage.format": {"storage.errors", "storage.settings"},
    "storage.stores": {"storage.errors", "storage.format"},
    "storage.checkpoint": {"storage.errors", "storage.format", "storage.stores"},
    "storage.stream": {"storage.errors", "storage.format", "storage.stores"},
    # engine: the shared toolkit, the model, its ranks, the serving loop, sessions moving, the faces
    "engine": set(),
    "engine.web": set(),
    "engine.tracing": set(),
    "engine.kv_cache": set(),
    "engine.command": set(),  # one-line errors and `python -m` entry points for the commands defined below
    "engine.model": {"engine.kv_cache", "engine.tracing"},
    "engine.ranks": {"engine.kv_cache", "engine.tracing", "engine.model", "engine.command"},
    "engine.runtime": {"engine.kv_cache", "engine.tracing", "engine.model", "engine.ranks"},
    "engine.moves": {"engine.kv_cache", "engine.tracing", "engine.model", "engine.ranks", "engine.runtime"},
    "engine.api": {"engine.web", "engine.kv_cache", "engine.tracing", "engine.model", "engine.ranks",
                   "engine.runtime", "engine.moves"},
    "engine.vllm": {"engine.web", "engine.tracing", "engine.model", "engine.ranks", "engine.runtime",
                    "engine.moves", "engine.api"},
    # migrate: transports carry the protocol's rounds; protection and placement use the protocol;
    # a replica process assembles them all; the gateway stands apart
    "migrate": set(),
    "migrate.procs": set(),
    "migrate.transport": set(),
    "migrate.protocol": {"migrate.procs", "migrate.transport"},
    "migrate.protection": {"migrate.procs", "migrate.transport", "migrate.protocol"},
    "migrate.placement": {"migrate.procs", "migrate.protocol"},
    "migrate.replica": {"migrate.procs", "migrate.transport", "migrate.protocol", "migrate.protection"},
    "migrate.gateway": {"migrate.procs"},
    # agent: its node's state, the routes over it, the REST clients, and the app and CLI on top
    "agent": set(),
    "agent.node": set(),
    "agent.routes": {"agent.node"},
    "agent.commands": {"agent.node"},
    "agent.agent": {"agent.node", "agent.routes"},
    "agent.cli": {"agent.node", "agent.routes", "agent.commands", "agent.agent"},
}
# Imports that the layering allows although they run upward: none. The CLI's bench commands and
# `relayout plan`'s EPLB yardstick come in through entry points, loaded by name.
ALLOWED_UPWARD: set[tuple[str, str]] = set()  # none: plugins come in through entry points


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. relayout.engine.api.server
    target: str  # the imported module (or a name in it), e.g. relayout.engine.workers
    line: int
    load_time: bool  # runs when `source` is imported: not inside a function nor `if TYPE_CHECKING:`


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([DIST, *parts])


def source_files(root: Path, packages: tuple[str, ...] = LAYERS) -> list[Path]:
    return sorted(p for pkg in packages if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_module_literal(node: ast.Call) -> str | None:
    """The name in `importlib.import_module("x")` / `import_module("x")`, if it is a literal."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]):
        self.module, self.known = module, known
        self.package = module if is_package else module.rpartition(".")[0]
        self.deferred = 0  # depth of function bodies and `if TYPE_CHECKING:` blocks around the node
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.AST) -> None:
        self.found.append(Import(self.module, target, node.lineno, self.deferred == 0))

    def _deferred(self, node: ast.AST) -> None:
        self.deferred += 1
        self.generic_visit(node)
        self.deferred -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _deferred

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.deferred += 1
        for child in node.body:
            self.visit(child)
        self.deferred -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolved against this module's package
            pkg = self.package.split(".")
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        for alias in node.names:
            # `from relayout.bench import soak` imports the module relayout.bench.soak
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.known else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _import_module_literal(node)
        if name is not None:
            self._add(name, node)
        self.generic_visit(node)


def walk_imports(root: Path, packages: tuple[str, ...] = LAYERS) -> list[Import]:
    files = source_files(root, packages)
    known = {module_name(root, p) for p in files}
    out: list[Import] = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        collector = _ImportCollector(module_name(root, path), path.name == "__init__.py", known)
        collector.visit(tree)
        out += collector.found
    return out


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == DIST and parts[1] in LAYERS else None


def layering_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is None or dst is None or (imp.source, imp.target) in ALLOWED_UPWARD:
            continue
        if LAYERS.index(dst) > LAYERS.index(src):
            bad.append(f"{imp.source}:{imp.line} imports {imp.target} ({src} may not import {dst})")
    return bad


def import_cycle(imports: list[Import]) -> list[str] | None:
    """One cycle of load-time imports among the walked modules, or None.

    Deferred imports (inside a function, or under `if TYPE_CHECKING:`) are left out: they run once
    both modules are fully initialised (or never), so they cannot meet a half-initialised module;
    they are how a module uses a higher-level helper lazily without a load-time dependency. They
    still count for the layering."""
    modules = {imp.source for imp in imports}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.load_time and imp.target in modules and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def subsystem_of(root: Path, module: str) -> str | None:
    """relayout.engine.model.moe -> engine.model; relayout.engine.web -> engine.web (a top module)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != DIST or parts[1] not in PRODUCT:
        return None
    if len(parts) == 2:
        return parts[1]
    return f"{parts[1]}.{parts[2]}"


def subsystem_violations(root: Path, imports: list[Import],
                         table: dict[str, set[str]] = SUBSYSTEMS) -> list[str]:
    bad = set()
    for imp in imports:
        src, dst = subsystem_of(root, imp.source), subsystem_of(root, imp.target)
        if src is None:
            continue
        if src not in table:
            bad.add(f"{imp.source}: subsystem {src} is not in SUBSYSTEMS (say what it may import)")
            continue
        if dst is None or dst == src or dst.split(".")[0] != src.split(".")[0] or dst == dst.split(".")[0]:
            continue  # another layer (the layering's business), itself, or its layer's package
        if dst not in table[src]:
            bad.add(f"{imp.source}:{imp.line} imports {imp.target} ({src} may not import {dst})")
    return sorted(bad)


def table_cycle(table: dict[str, set[str]] = SUBSYSTEMS) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(table).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def crowded_folders(root: Path, dirs: tuple[str, ...] = LAYERS, limit: int = MAX_MODULES) -> list[str]:
    folders = {p.parent for p in source_files(root, dirs)}
    out = []
    for d in sorted(folders):
        n = len(list(d.glob("*.py")))
        if n > limit:
            out.append(f"{d.relative_to(root).as_posix()}/: {n} modules")
    return out


def long_functions(root: Path, dirs: tuple[str, ...] = PRODUCT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for path in source_files(root, dirs):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name}: {n} lines")
    return out


def packages_on_disk(root: Path, dirs: tuple[str, ...] = LAYERS) -> set[str]:
    return {module_name(root, p) for p in source_files(root, dirs) if p.name == "__init__.py"}


# ---- the repository ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def repo_imports() -> list[Import]:
    return walk_imports(ROOT)


def test_walker_sees_the_tree(repo_imports):
    # a walker that found nothing would pass every check below
    sources = {imp.source for imp in repo_imports}
    assert {layer_of(s) for s in sources} == set(LAYERS)
    assert any(imp.source == "relayout.agent.cli" and imp.target.startswith("relayout.migrate.placement.plan_cli")
               and not imp.load_time for imp in repo_imports)  # an import inside a function
    assert any(imp.source == "relayout.engine.runtime.engine" and imp.target == "relayout.engine.ranks.workers"
               and not imp.load_time for imp in repo_imports)  # under `if TYPE_CHECKING:`


def test_layering(repo_imports):
    bad = layering_violations(repo_imports)
    order = ", ".join(LAYERS)
    assert not bad, f"upward imports (a package imports only those before it in: {order}):\n" + "\n".join(bad)


def test_allowed_upward_imports_still_exist(repo_imports):
    # an exception that no longer matches any import should be removed, not linger as a loophole
    pairs = {(imp.source, imp.target) for imp in repo_imports}
    assert ALLOWED_UPWARD <= pairs, ALLOWED_UPWARD - pairs


def test_no_import_cycles(repo_imports):
    cycle = import_cycle(repo_imports)
    assert cycle is None, "load-time import cycle: " + " -> ".join(cycle)


def test_subsystems_import_only_what_the_table_allows(repo_imports):
    bad = subsystem_violations(ROOT, repo_imports)
    assert not bad, "imports across subsystems that SUBSYSTEMS does not allow:\n" + "\n".join(bad)


def test_the_subsystem_table_has_no_cycle_and_names_what_exists():
    assert table_cycle() is None, table_cycle()
    on_disk = {subsystem_of(ROOT, module_name(ROOT, p)) for p in source_files(ROOT, PRODUCT)}
    assert on_disk == set(SUBSYSTEMS), (on_disk ^ set(SUBSYSTEMS))


def test_each_product_folder_holds_subpackages_and_few_modules_at_its_top():
    for layer in PRODUCT:
        subs = [d for d in (ROOT / layer).iterdir() if (d / "__init__.py").is_file()]
        assert len(subs) >= 2, f"{layer}/ holds {len(subs)} subpackage(s)"
    crowded = crowded_folders(ROOT)
    assert not crowded, f"folders with more than {MAX_MODULES} modules at their top (split by concern):\n" + \
        "\n".join(crowded)


def test_no_product_function_over_the_limit():
    long = long_functions(ROOT)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split into stages):\n" + "\n".join(long)


def test_every_package_is_installed():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == packages_on_disk(ROOT)


# ---- the checks themselves, on synthetic trees ------------------------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_walker_flags_upward_imports_in_every_form(tmp_path):
    root = _tree(tmp_path, {
        "storage/__init__.py": "",
        "storage/fmt.py": "from relayout.engine.model import Model\n",
        "engine/__init__.py": "",
        "engine/model.py": "def f():\n    import relayout.migrate.live\n",
        "engine/lazy.py": "import importlib\n\ndef g():\n    return importlib.import_module('relayout.agent.cli')\n",
        "engine/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relayout.bench import soak\n",
        "migrate/__init__.py": "",
        "migrate/live.py": "from ..storage import fmt\nfrom relayout.engine import model\n",
        "bench/__init__.py": "",
        "bench/soak.py": "from relayout.agent import cli\n",
    })
    bad = layering_violations(walk_imports(root))
    assert len(bad) == 4, bad
    assert any(b.startswith("relayout.storage.fmt:1 imports relayout.engine.model") for b in bad)
    assert any(b.startswith("relayout.engine.model:2 imports relayout.migrate.live") for b in bad)
    assert any(b.startswith("relayout.engine.lazy:4 imports relayout.agent.cli") for b in bad)
    assert any(b.startswith("relayout.engine.typed:3 imports relayout.bench.soak") for b in bad)
    # downward, relative and bench's imports pass
    assert not any(b.startswith(("relayout.migrate.", "relayout.bench.")) for b in bad)


def test_relative_imports_resolve(tmp_path):
    root = _tree(tmp_path, {"migrate/__init__.py": "from . import live\n", "migrate/live.py": "from .x import y\n",
                            "storage/__init__.py": "", "storage/fmt.py": "from ..agent.cli import app\n"})
    targets = {(i.source, i.target) for i in walk_imports(root)}
    assert targets == {("relayout.migrate", "relayout.migrate.live"), ("relayout.migrate.live", "relayout.migrate.x"),
                       ("relayout.storage.fmt", "relayout.agent.cli")}


def test_cycle_check_finds_load_time_cycles_only(tmp_path):
    root = _tree(tmp_path, {
        "engine/a.py": "from relayout.engine import b\n",
        "engine/b.py": "import relayout.engine.c\n",
        "engine/c.py": "from relayout.engine.a import thing\n",
    })
    cycle = import_cycle(walk_imports(root))
    assert cycle is not None and set(cycle) == {"relayout.engine.a", "relayout.engine.b", "relayout.engine.c"}
    (root / "engine/c.py").write_text("def later():\n    from relayout.engine.a import thing\n")
    assert import_cycle(walk_imports(root)) is None


def test_subsystem_check_flags_sideways_imports_and_cycles(tmp_path):
    root = _tree(tmp_path, {
        "engine/__init__.py": "", "engine/web.py": "",
        "engine/model/__init__.py": "", "engine/model/moe.py": "from relayout.engine.runtime import engine\n",
        "engine/runtime/__init__.py": "", "engine/runtime/engine.py": "from relayout.engine.model.moe import M\n"
                                                                         "from relayout.engine import web\n",
        "engine/extra/__init__.py": "", "engine/extra/x.py": "from relayout.storage import errors\n",
    })
    table = {"engine": set(), "engine.web": set(), "engine.model": set(), "engine.runtime": {"engine.model"}}
    bad = subsystem_violations(root, walk_imports(root), table)
    assert any(b.startswith("relayout.engine.model.moe:1 imports relayout.engine.runtime") for b in bad), bad
    assert any("relayout.engine.runtime.engine:2 imports relayout.engine.web" in b for b in bad), bad
    assert any("subsystem engine.extra is not in SUBSYSTEMS" in b for b in bad), bad
    assert len(bad) == 3, bad
    assert table_cycle({"a": {"b"}, "b": {"a"}}) is not None and table_cycle(table) is None


def test_folder_and_function_checks_list_offenders(tmp_path):
    body = "def f():\n" + "    x = 1\n" * 80  # 81 lines
    files = {f"engine/m{i}.py": "" for i in range(15)} | {"migrate/ok.py": "def g():\n    pass\n",
                                                          "migrate/long.py": body, "bench/long.py": body}
    root = _tree(tmp_path, files)
    assert crowded_folders(root) == []
    (root / "engine/m15.py").write_text("")
    assert crowded_folders(root) == ["engine/: 16 modules"]
    assert long_functions(root) == ["migrate/long.py:1 f: 81 lines"]  # bench is not product
