"""The house's floors: each package imports only the packages below it (admin and service -> tasks ->
reservations -> fencing; admin and service share the top floor and neither imports the other), and
nothing below the operator's floor starts processes. Read from the source, so a new module that reaches
up fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ["fencing", "reservations", "tasks"]  # bottom first
TOP = ["admin", "service"]  # the top floor: the operator's command line and the HTTP front door


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _above(package: str) -> set[str]:
    if package in TOP:
        return set(TOP) - {package}
    return set(FLOORS[FLOORS.index(package) + 1 :]) | set(TOP)


@pytest.mark.parametrize("package", [*FLOORS, *TOP])
def test_a_package_imports_only_the_floors_below_it(package: str) -> None:
    above = _above(package)
    wrong = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & above)
        for path in sorted((ROOT / package).rglob("*.py"))
        if _imports(path) & above
    }
    assert wrong == {}


@pytest.mark.parametrize("package", [*FLOORS, "service"])
def test_only_the_operators_floor_starts_processes(package: str) -> None:
    starting = {
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / package).rglob("*.py"))
        if "subprocess" in _imports(path)
    }
    assert starting == set()
