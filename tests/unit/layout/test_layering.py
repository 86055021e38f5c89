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

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("storage", "events", "pipeline", "infra")

#: What each lower layer must not import.
FORBIDDEN = {
    "storage": ("events", "pipeline", "infra"),
    "events": ("pipeline", "infra"),
}

#: Inside pipeline/: what each capability (a subpackage) may import of the others. The shared
#: top-level modules (``pipeline.settings``, ``pipeline.metrics``) are open to all; they import only
#: ``media``'s decode settings. docs/architecture.md draws the same arrows.
TOP = "top"
CAPABILITY_IMPORTS: dict[str, frozenset[str]] = {
    TOP: frozenset({"media", "text"}),
    "media": frozenset(),
    "embedding": frozenset(),
    "query": frozenset(),
    "reindex": frozenset(),
    "jobs": frozenset(),
    "text": frozenset({"media"}),
    "index": frozenset({"media", "embedding", "jobs", "reindex", "text"}),
    "upkeep": frozenset({"jobs", "reindex"}),
    "api": frozenset({"jobs", "query", "reindex", "upkeep"}),
    "serve": frozenset({"api", "embedding", "index", "jobs", "media", "query", "reindex", "upkeep"}),
    "cli": frozenset({"embedding", "jobs", "reindex", "serve", "upkeep"}),
}
#: How a job is run (``pipeline.index``) is the consumers' business: only the composition root reaches it;
#: everything else submits jobs and changes rows through ``pipeline.jobs``.
INDEX_IMPORTERS = frozenset({"serve"})
#: The packages that hold tests and benchmarks; neither is imported by the product. Benchmarks share
#: the tests' harnesses through ``infra.harness``, never by importing ``tests``.
CHECKED = (*PACKAGES, "bench", "tests")

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
    assert {"storage.catalog", "events.router", "pipeline.serve.app", "infra.dev.stack"} <= set(known)
    # Sanity: it sees the imports it must see (a module-level one, a lazy one in a constructor).
    pairs = {(i.source, i.target) for i in found}
    assert ("storage.tables", "storage.catalog") in pairs
    assert ("pipeline.serve.consumer", "pipeline.index.replica") in pairs


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


def serve_modules(root: Path = ROOT) -> list[str]:
    """The Serve app's modules: the composition root, ``pipeline.serve`` (what its deployments import
    lazily, in their constructors, is followed by ``import_chains``)."""
    return [m for m in module_files(root, ["pipeline"]) if m == "pipeline.serve" or m.startswith("pipeline.serve.")]


def test_nothing_the_serve_app_can_import_reaches_infra(found: list[Import]) -> None:
    chains = import_chains(found, serve_modules())
    bad = {m: chain for m, chain in chains.items() if m == "infra" or m.startswith("infra.")}
    report = "\n\n".join("\n".join(str(i) for i in chain) for chain in bad.values())
    assert bad == {}, f"the Serve app's modules can import infra/ (lazy imports included):\n{report}"


def test_the_serve_app_loads_no_dev_tooling() -> None:
    loaded = loaded_modules(serve_modules())
    assert "pipeline.serve.app" in loaded
    dev = [m for m in loaded if m == "infra.dev" or m.startswith("infra.dev.")]
    assert dev == [], f"importing the Serve app loads dev tooling: {dev}"


def capability(module: str) -> str | None:
    """The capability of a ``pipeline`` module: its subpackage, ``TOP`` for a shared top-level
    module, None outside ``pipeline`` (and for ``pipeline`` itself)."""
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) == 1:
        return None
    return parts[1] if parts[1] in CAPABILITY_IMPORTS and parts[1] != TOP else TOP


def crossing_imports(found: Iterable[Import], allowed: dict[str, frozenset[str]]) -> list[Import]:
    """Imports from one capability of pipeline/ into another that ``allowed`` does not list."""
    bad = []
    for imp in found:
        source, target = capability(imp.source), capability(imp.target)
        if source is None or target is None or source == target or (target == TOP and source != TOP):
            continue
        if target not in allowed.get(source, frozenset()):
            bad.append(imp)
    return bad


def imports_of_tests(found: Iterable[Import]) -> list[Import]:
    """Imports of ``tests`` from any module outside it."""
    return [i for i in found if i.target.split(".")[0] == "tests" and i.source.split(".")[0] != "tests"]


def dev_tooling_importers(found: Iterable[Import], package: str) -> set[str]:
    """The modules of ``package`` that import ``infra.dev`` themselves."""
    return {
        i.source
        for i in found
        if (i.source == package or i.source.startswith(package + "."))
        and (i.target == "infra.dev" or i.target.startswith("infra.dev."))
    }


def test_every_capability_of_pipeline_is_known() -> None:
    folders = {p.name for p in (ROOT / "pipeline").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(CAPABILITY_IMPORTS) - {TOP}


def test_capabilities_inside_pipeline_import_only_what_they_may(found: list[Import]) -> None:
    bad = [str(i) for i in crossing_imports(found, CAPABILITY_IMPORTS)]
    report = "\n".join(bad)
    assert bad == [], f"imports across pipeline/'s capabilities that CAPABILITY_IMPORTS does not allow:\n{report}"


def test_media_and_embedding_import_no_sibling_capability(found: list[Import]) -> None:
    bad = [
        str(i)
        for i in found
        if capability(i.source) in ("media", "embedding")
        and capability(i.target) not in (None, TOP, capability(i.source))
    ]
    assert bad == [], "media/ or embedding/ imports another capability:\n" + "\n".join(bad)


def index_importers(found: Iterable[Import]) -> list[Import]:
    """Imports of ``pipeline.index`` from a capability that ``INDEX_IMPORTERS`` does not name."""
    return [
        i
        for i in found
        if capability(i.target) == "index" and capability(i.source) not in (None, "index", *INDEX_IMPORTERS)
    ]


def test_only_the_composition_root_imports_how_a_job_runs(found: list[Import]) -> None:
    bad = [str(i) for i in index_importers(found)]
    assert bad == [], "pipeline.index imported outside pipeline/serve:\n" + "\n".join(bad)


def test_the_product_imports_no_dev_tooling(found: list[Import]) -> None:
    """The local stack registers its commands with the CLI (the ``vidx.cli`` entry point): no module of
    the product imports ``infra``, so no arrow runs back up."""
    assert dev_tooling_importers(found, "pipeline") == set()
    assert [str(i) for i in found if i.source.split(".")[0] != "infra" and i.target.split(".")[0] == "infra"] == []


def test_benchmarks_import_no_tests() -> None:
    bad = [str(i) for i in imports_of_tests(imports(ROOT, CHECKED))]
    assert bad == [], "modules outside tests/ import tests/ (shared harnesses go in infra/harness):\n" + "\n".join(bad)


def test_the_local_stack_registers_its_commands_with_the_cli() -> None:
    """``vidx up`` and friends come from the ``vidx.cli`` entry point, not from an import in the CLI."""
    from pipeline.cli.main import app

    names = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    assert {"up", "down", "status", "demo", "tiny-model"} <= names


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


def test_the_checker_finds_crossing_capabilities_dev_tooling_in_the_cli_and_infra_in_the_serve_app(
    tmp_path: Path,
) -> None:
    root = _tree(
        tmp_path,
        {
            "storage/__init__.py": "",
            "events/__init__.py": "",
            "infra/__init__.py": "",
            "infra/dev/__init__.py": "",
            "infra/dev/stack.py": "",
            "infra/images.py": "",
            "pipeline/__init__.py": "",
            "pipeline/settings.py": "from pipeline.media import settings\n",
            "pipeline/media/__init__.py": "",
            "pipeline/media/settings.py": "",
            "pipeline/media/decode.py": "def lazy():\n    from pipeline.index import jobs\n",
            "pipeline/embedding/__init__.py": "",
            "pipeline/embedding/model.py": "from pipeline import settings\n",
            "pipeline/index/__init__.py": "",
            "pipeline/index/jobs.py": "from pipeline.media.decode import lazy\nfrom pipeline.query import search\n",
            "pipeline/query/__init__.py": "",
            "pipeline/query/search.py": "",
            "pipeline/cli/__init__.py": "",
            "infra/dev/cli.py": "from infra.dev import stack\n",
            "pipeline/cli/upload.py": "def f():\n    import infra.dev.stack\n",
            "pipeline/serve/__init__.py": "",
            "pipeline/serve/app.py": "def build():\n    from pipeline.index import late\n",
            "pipeline/index/late.py": "def f():\n    from infra import images\n",
            "pipeline/jobs/__init__.py": "",
            "pipeline/jobs/videostate.py": "",
            "pipeline/api/__init__.py": "",
            "pipeline/api/service.py": "from pipeline.jobs import videostate\nfrom pipeline.index import late\n",
            "tests/__init__.py": "",
            "tests/services.py": "from infra.dev import stack\n",
            "bench/__init__.py": "",
            "bench/flood.py": "def f():\n    from tests.services import start\n",
        },
    )
    found = imports(root)
    crossing = sorted((i.source, i.target) for i in crossing_imports(found, CAPABILITY_IMPORTS))
    # media -> index (lazy), index -> query and api -> index are not allowed; top -> media, index ->
    # media, api -> jobs and serve -> index are; anything -> the top-level settings is.
    assert crossing == [
        ("pipeline.api.service", "pipeline.index.late"),
        ("pipeline.index.jobs", "pipeline.query.search"),
        ("pipeline.media.decode", "pipeline.index.jobs"),
    ]
    assert sorted((i.source, i.target) for i in index_importers(found)) == [
        ("pipeline.api.service", "pipeline.index.late"),
        ("pipeline.media.decode", "pipeline.index.jobs"),
    ]
    everything = imports(root, CHECKED)
    assert [(i.source, i.target) for i in imports_of_tests(everything)] == [("bench.flood", "tests.services")]
    assert dev_tooling_importers(found, "pipeline.cli") == {"pipeline.cli.upload"}
    assert dev_tooling_importers(found, "pipeline") == {"pipeline.cli.upload"}
    serve = serve_modules(root)
    assert serve == ["pipeline.serve", "pipeline.serve.app"]
    reached = import_chains(found, serve)
    assert [(i.source, i.target) for i in reached["infra.images"]] == [
        ("pipeline.serve.app", "pipeline.index.late"),
        ("pipeline.index.late", "infra.images"),
    ]
