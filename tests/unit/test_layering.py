"""Layers point one way (STYLE.md 12): storage <- events <- pipeline, infra on top; no import cycles;
the Serve app and the settings load nothing they do not run (no dev tooling, no PyAV).

Imports are read with ``ast`` from every module of the four packages, wherever they sit: module level,
inside functions, under ``if TYPE_CHECKING:`` or ``try:``. ``from x import y`` counts as an import of
``x.y`` when that is a module, else of ``x``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("storage", "events", "pipeline", "infra")

#: What each lower layer must not import.
FORBIDDEN = {
    "storage": ("events", "pipeline", "infra"),
    "events": ("pipeline", "infra"),
}

#: The Serve app's module and what its deployments import lazily (in their constructors).
SERVE_MODULES = (
    "pipeline.serve.deployments",
    "pipeline.serve.config",
    "pipeline.embedding.encoders",
    "pipeline.index.consumer",
    "pipeline.index.indexer",
    "pipeline.api.app",
    "pipeline.api.admin",
    "pipeline.query.search",
    "pipeline.api.node_metrics",
    "pipeline.upkeep.check",
    "pipeline.upkeep.scheduled",
    "pipeline.index.holders",
    "pipeline.media.workers",
    "events.parked",
    "pipeline.index.taskqueue",
    "pipeline.index.videostate",
    "storage.maintenance",
    "events.router",
)

SUBPROCESS_TIMEOUT_S = 90


@dataclass(frozen=True, slots=True)
class Import:
    source: str
    target: str
    #: The importing file, relative to the root, and the line of the import.
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} -> {self.target}"


def module_files(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """``name`` or its nearest ancestor among the known modules."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports(root: Path, packages: Iterable[str] = PACKAGES) -> list[Import]:
    """Every import of one known module by another (self-imports left out)."""
    known = module_files(root, packages)
    found: list[Import] = []
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_resolve(alias.name, known) for alias in node.names]
            else:
                if node.level:
                    # Relative: ``.`` is the module's package (the package itself for an ``__init__``).
                    anchor = module.split(".")
                    drop = node.level - 1 if is_package else node.level
                    anchor = anchor[: len(anchor) - drop] if drop else anchor
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                for alias in node.names:
                    targets.append(_resolve(f"{base}.{alias.name}", known) or _resolve(base, known))
            for target in dict.fromkeys(targets):  # one per target, however many names it gives
                if target is not None and target != module:
                    found.append(Import(module, target, str(path.relative_to(root)), node.lineno))
    return found


def upward_imports(found: Iterable[Import]) -> list[Import]:
    return [
        imp
        for imp in found
        for banned in FORBIDDEN.get(imp.source.split(".")[0], ())
        if imp.target.split(".")[0] == banned
    ]


def cycles(found: Iterable[Import]) -> list[list[Import]]:
    """The imports inside each group of modules that import each other round in a circle (the
    strongly connected components of more than one module, Tarjan's algorithm)."""
    edges: dict[str, list[Import]] = {}
    for imp in found:
        edges.setdefault(imp.source, []).append(imp)
        edges.setdefault(imp.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(start: str) -> None:
        # Iterative depth-first search: no recursion limit to meet, however deep the chains get.
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, rest = work[-1]
            step = next(rest, None)
            if step is not None:
                nxt = step.target
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)

    for node in list(edges):
        if node not in index:
            visit(node)
    return [
        sorted((imp for imp in found if imp.source in c and imp.target in c), key=lambda i: (i.source, i.line))
        for c in components
    ]


def import_chains(found: Iterable[Import], starts: Iterable[str]) -> dict[str, list[Import]]:
    """Every module ``starts`` can import, directly or through others (lazy imports included), with
    one chain of imports that gets there."""
    edges: dict[str, list[Import]] = {}
    for imp in found:
        edges.setdefault(imp.source, []).append(imp)
    chains: dict[str, list[Import]] = {s: [] for s in starts}
    todo = list(chains)
    while todo:
        module = todo.pop()
        for imp in edges.get(module, []):
            if imp.target not in chains:
                chains[imp.target] = [*chains[module], imp]
                todo.append(imp.target)
    return chains


def loaded_modules(modules: Iterable[str]) -> list[str]:
    """``sys.modules`` of a fresh interpreter after importing ``modules``."""
    code = textwrap.dedent(
        f"""
        import json, sys
        for name in {list(modules)!r}:
            __import__(name)
        print(json.dumps(sorted(sys.modules)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


# -- the rules over the real tree ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def found() -> list[Import]:
    return imports(ROOT)


def test_the_checker_reads_every_package(found: list[Import]) -> None:
    known = module_files(ROOT)
    assert {"storage.catalog", "events.router", "pipeline.serve.deployments", "infra.dev.stack"} <= set(known)
    # Sanity: it sees the imports it must see (a module-level one, a lazy one in a constructor).
    pairs = {(i.source, i.target) for i in found}
    assert ("storage.tables", "storage.catalog") in pairs
    assert ("pipeline.serve.deployments", "pipeline.index.consumer") in pairs


def test_storage_imports_nothing_above_it(found: list[Import]) -> None:
    bad = [str(i) for i in upward_imports(found) if i.source.startswith("storage")]
    assert bad == [], "storage/ imports from a layer above it:\n" + "\n".join(bad)


def test_events_imports_nothing_above_it(found: list[Import]) -> None:
    bad = [str(i) for i in upward_imports(found) if i.source.startswith("events")]
    assert bad == [], "events/ imports from a layer above it:\n" + "\n".join(bad)


def test_no_import_cycles(found: list[Import]) -> None:
    groups = cycles(found)
    report = "\n\n".join("\n".join(str(i) for i in group) for group in groups)
    assert groups == [], f"{len(groups)} import cycle(s); the imports inside each:\n{report}"


def test_nothing_the_serve_app_can_import_reaches_dev_tooling(found: list[Import]) -> None:
    chains = import_chains(found, SERVE_MODULES)
    bad = {m: chain for m, chain in chains.items() if m == "infra.dev" or m.startswith("infra.dev.")}
    report = "\n\n".join("\n".join(str(i) for i in chain) for chain in bad.values())
    assert bad == {}, f"the Serve app's modules can import dev tooling (lazy imports included):\n{report}"


def test_the_serve_app_loads_no_dev_tooling() -> None:
    loaded = loaded_modules(SERVE_MODULES)
    assert "pipeline.serve.deployments" in loaded
    dev = [m for m in loaded if m == "infra.dev" or m.startswith("infra.dev.")]
    assert dev == [], f"importing the Serve app loads dev tooling: {dev}"


def test_the_settings_do_not_load_pyav() -> None:
    loaded = loaded_modules(["pipeline.settings"])
    assert "pipeline.settings" in loaded
    av = [m for m in loaded if m == "av" or m.startswith("av.")]
    assert av == [], f"importing pipeline.settings loads PyAV: {av[:5]}"


# -- the checker itself: it fails on what it must fail on ---------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_checker_finds_lazy_upward_imports_and_cycles(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "storage/__init__.py": "",
            "storage/a.py": """
                from __future__ import annotations
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from events import jobs
                def lazy():
                    import pipeline.b
                """,
            "storage/c.py": "from . import a\n",
            "events/__init__.py": "",
            "events/jobs.py": "from storage.a import x\n",
            "pipeline/__init__.py": "",
            "pipeline/b.py": "import os\n",
            "pipeline/d.py": "from pipeline import e\n",
            "pipeline/e.py": "def f():\n    from .d import g\n",
            "infra/__init__.py": "",
        },
    )
    found = imports(root)
    pairs = {(i.source, i.target) for i in found}
    assert ("storage.c", "storage.a") in pairs  # relative, resolved to the submodule
    assert ("pipeline.d", "pipeline.e") in pairs and ("pipeline.e", "pipeline.d") in pairs
    upward = sorted((i.source, i.target, i.line) for i in upward_imports(found))
    assert upward == [("storage.a", "events.jobs", 5), ("storage.a", "pipeline.b", 7)]
    groups = [sorted({i.source for i in g}) for g in cycles(found)]
    assert sorted(groups) == [["events.jobs", "storage.a"], ["pipeline.d", "pipeline.e"]]
    chain = import_chains(found, ["storage.c"])["pipeline.b"]  # through a lazy import in a function
    assert [(i.source, i.target) for i in chain] == [("storage.c", "storage.a"), ("storage.a", "pipeline.b")]
