"""Each package's public face is what README.md shows of it. Every Python example of the README and of
docs/ imports from package roots only, and only names of that package's ``__all__``; every name of an
``__all__`` is shown in the README section that presents the package, in an example or as code in its
text. A name the README does not show stays importable from its own module, for the project's own code.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = frozenset({"admin", "fencing", "reservations", "service", "tasks"})
# The README section (its "## " heading) that presents each package with a public API.
SECTIONS = {
    "fencing": "The fencing core in ten lines",
    "reservations": "The inventory domain",
    "tasks": "Running it",
    "service": "The HTTP service",
}
FENCED = re.compile(r"^```([\w-]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`\n]+)`")


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _examples() -> list[tuple[str, str]]:
    """Every Python example of the README and docs/, with the file it is in."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for language, body in FENCED.findall(path.read_text()):
            if language in ("python", "py"):
                found.append((path.name, body))
    return found


def _imports(source: str) -> list[tuple[str, str | None]]:
    """(module, name) of every import of ``source``; the name is None for ``import module``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.extend((node.module, alias.name) for alias in node.names)
    return found


def _section(heading: str) -> str:
    parts = re.split(r"^## ", _readme(), flags=re.MULTILINE)
    matching = [part for part in parts if part.startswith(f"{heading}\n")]
    assert len(matching) == 1, f"README.md has no single section '## {heading}'"
    return matching[0]


def _shown(section: str) -> str:
    """The code of a section: its examples and the spans of its text written as code."""
    blocks = [body for _, body in FENCED.findall(section)]
    text = FENCED.sub("", section)
    return "\n".join([*blocks, *INLINE.findall(text)])


def test_the_examples_exist() -> None:
    assert {"README.md"} <= {where for where, _ in _examples()}
    for heading in ("The fencing core in ten lines", "The inventory domain", "Running it"):
        assert FENCED.search(_section(heading)), heading


def test_examples_import_from_package_roots_only() -> None:
    deep = [
        f"{where}: {module}" + (f" ({name})" if name else "")
        for where, source in _examples()
        for module, name in _imports(source)
        if module.split(".")[0] in PACKAGES and "." in module
    ]
    assert deep == []


def test_examples_import_only_public_names() -> None:
    private = [
        f"{where}: from {module} import {name}"
        for where, source in _examples()
        for module, name in _imports(source)
        if module in PACKAGES and name is not None and name not in importlib.import_module(module).__all__
    ]
    assert private == []


@pytest.mark.parametrize("package", sorted(SECTIONS))
def test_every_public_name_is_shown_in_the_packages_section(package: str) -> None:
    shown = _shown(_section(SECTIONS[package]))
    public = importlib.import_module(package).__all__
    assert [name for name in public if not re.search(rf"\b{re.escape(name)}\b", shown)] == []


@pytest.mark.parametrize("package", sorted(SECTIONS))
def test_every_public_name_is_importable_and_listed_once(package: str) -> None:
    module = importlib.import_module(package)
    assert len(set(module.__all__)) == len(module.__all__)
    assert [name for name in module.__all__ if not hasattr(module, name)] == []
