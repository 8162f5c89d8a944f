"""The house's floors: each package imports only the packages below it (admin and service -> tasks ->
reservations -> fencing; admin and service share the top floor and neither imports the other; testing,
the process harness, sits between the library and the operator's floor, and the service never imports
it), no module
imports itself back through others (no import circles), the library imports the project only at the top
of a module (an import inside a function hides a circle), and nothing below the operator's floor starts
processes. Read from the source, so a new module that reaches up or around fails here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ["fencing", "reservations", "tasks"]  # bottom first
TOOLS = "testing"  # the process harness the operator's tools, the tests and the bench share
TOP = ["admin", "service"]  # the top floor: the operator's command line and the HTTP front door
LIBRARY = [*FLOORS, "service"]
PROJECT = [*LIBRARY, TOOLS, "admin", "bench"]


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _above(package: str) -> set[str]:
    if package == "service":
        return {"admin", TOOLS}
    if package in TOP:
        return set(TOP) - {package}
    if package == TOOLS:
        return set(TOP)
    return set(FLOORS[FLOORS.index(package) + 1 :]) | set(TOP) | {TOOLS}


@pytest.mark.parametrize("package", [*FLOORS, TOOLS, *TOP])
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


def _modules(packages: list[str]) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _project_imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], list[int]]:
    """The project's modules ``path`` imports at its top level (``from pkg import mod`` is ``pkg.mod``),
    and the lines where it imports the project anywhere else (in a function, a class, or a block). A
    module-level ``if TYPE_CHECKING:`` counts as the top: it runs nothing, and it declares a dependency
    that a lazily exporting package (``tasks``) has all the same, so the floors and circles include it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = [
        node.body
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    top = {id(node) for node in [*tree.body, *(n for body in typing_only for n in body)]}
    found: set[str] = set()
    elsewhere: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            ]
        else:
            continue
        names = [name for name in names if name.split(".")[0] in PROJECT]
        if names and id(node) not in top:
            elsewhere.append(node.lineno)
        for name in names if id(node) in top else []:
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            found.add(name)
    return found, elsewhere


@pytest.mark.parametrize("package", LIBRARY)
def test_the_library_imports_the_project_only_at_the_top_of_a_module(package: str) -> None:
    # The tools' floors (admin, bench) may import a large module inside the command that needs it, so
    # that other commands start fast; the library has no such reason.
    modules = _modules(PROJECT)
    inside = {
        str(path.relative_to(ROOT)): lines
        for name, path in modules.items()
        if name.split(".")[0] == package and (lines := _project_imports(path, modules)[1])
    }
    assert inside == {}


def test_no_import_circles() -> None:
    modules = _modules(PROJECT)
    graph = {name: _project_imports(path, modules)[0] - {name} for name, path in modules.items()}
    circles = [sorted(group) for group in _strongly_connected(graph) if len(group) > 1]
    assert circles == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the groups of modules that import each other round a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(group)
    return groups


def test_no_test_module_imports_another_or_the_conftest() -> None:
    # What tests share lives in testing/ (stores, harness, clusters, checks); a test module reaching into
    # another would make one file's helpers another's fixtures. The programs tests start (a worker app,
    # a contender) stay beside them in tests/, and the harness imports none of tests/.
    reaching = {}
    for path in sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / TOOLS).rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            for name in names:
                top, _, rest = name.partition(".")
                wrong = top == "tests" and (
                    path.parent.name == TOOLS or rest == "conftest" or rest.startswith("test_")
                )
                if wrong:
                    reaching.setdefault(str(path.relative_to(ROOT)), []).append(name)
    assert reaching == {}


def test_the_command_line_starts_without_celery_and_the_tasks_package_exports_every_name() -> None:
    """``tasks`` exports its names when first asked for: importing the command line (which reads
    ``tasks.settings``) loads neither Celery nor kombu nor an HTTP client, and every name ``tasks``
    promises is there when asked for."""
    probe = (
        "import sys, admin.cli\n"
        "print(sorted(m for m in ('celery', 'kombu', 'httpx') if m in sys.modules))\n"
        "import tasks\n"
        "print(all(getattr(tasks, name) is not None for name in tasks.__all__))\n"
        "print('celery' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["[]", "True", "True"], done.stdout
