"""Sizes that say a thing has become several things (STYLE.md 1): no product function over
``MAX_FUNCTION_LINES`` lines, no folder of product, harness, bench or test code over ``MAX_FOLDER_MODULES``
modules, and no test file at the top of ``tests/unit`` (unit tests mirror the capability they test).
A count is a prompt to look, not a reason to cut: a split follows what the code is."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PRODUCT = ("pipeline", "events", "storage")
FOLDERS = (*PRODUCT, "infra", "bench", "tests")
MAX_FUNCTION_LINES = 60
MAX_FOLDER_MODULES = 15


def function_lengths(root: Path, packages: tuple[str, ...] = PRODUCT) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function and method, decorators left out, longest first."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    found.append((lines, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def folder_sizes(root: Path, folders: tuple[str, ...] = FOLDERS) -> dict[str, int]:
    """Modules (``.py`` files other than ``__init__.py``) directly in each folder that holds any."""
    sizes: dict[str, int] = {}
    for top in folders:
        for folder in [root / top, *(p for p in (root / top).rglob("*") if p.is_dir())]:
            if "__pycache__" in folder.parts or ".venv" in folder.parts:
                continue
            count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
            if count:
                sizes[str(folder.relative_to(root))] = count
    return sizes


def test_no_product_function_is_over_the_limit() -> None:
    over = [f"{lines} {where}" for lines, where in function_lengths(ROOT) if lines > MAX_FUNCTION_LINES]
    assert over == [], f"product functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(over)


def test_no_folder_holds_more_modules_than_the_limit() -> None:
    over = {folder: n for folder, n in folder_sizes(ROOT).items() if n > MAX_FOLDER_MODULES}
    assert over == {}, f"folders over {MAX_FOLDER_MODULES} modules: {over}"


def test_unit_tests_sit_in_their_capabilitys_folder() -> None:
    top = sorted(p.name for p in (ROOT / "tests" / "unit").glob("*.py") if p.name != "__init__.py")
    assert top == [], f"test files at the top of tests/unit: {top}"


def test_the_counts_see_what_they_must(tmp_path: Path) -> None:
    (tmp_path / "pipeline" / "a").mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pipeline" / "a" / "long.py").write_text(f"@decorated\ndef f():\n{body}\n\ndef g():\n    pass\n")
    for i in range(MAX_FOLDER_MODULES + 1):
        (tmp_path / "pipeline" / "a" / f"m{i}.py").write_text("")
    (tmp_path / "pipeline" / "a" / "__init__.py").write_text("")
    assert function_lengths(tmp_path)[0] == (MAX_FUNCTION_LINES + 1, "pipeline/a/long.py:2 f")
    assert folder_sizes(tmp_path, ("pipeline",)) == {"pipeline/a": MAX_FOLDER_MODULES + 2}
