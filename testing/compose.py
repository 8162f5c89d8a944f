"""The reference deployment file as docker-compose reads it: ``docker-compose config`` run on compose.yaml
with variables of the test's choosing and none of the caller's (a RESERVATIONS_* or COMPOSE_* variable
exported in the shell that runs the tests is not the file's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"


def compose(*args: str, file: Path = COMPOSE, **variables: str) -> str:
    """``docker-compose -f compose.yaml ARGS`` with these variables set (and no profile from outside)."""
    done = subprocess.run(
        ["docker-compose", "-f", str(file), *args],
        env={**_without_ours(os.environ), "COMPOSE_PROFILES": "", **variables},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def resolved(*args: str, file: Path = COMPOSE, **variables: str) -> dict[str, Any]:
    """``docker-compose config`` as data. docker-compose 1.x is a Python program whose own interpreter
    has PyYAML (this project does not depend on it); 2.x prints JSON when asked."""
    first_line = Path(shutil.which("docker-compose") or "").read_bytes()[:200].partition(b"\n")[0]
    if not first_line.startswith(b"#!"):
        text = compose(*args, "config", "--format", "json", file=file, **variables)
        data: dict[str, Any] = json.loads(text)
        return data
    to_json = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
    done = subprocess.run(
        [*first_line[2:].decode().split(), "-c", to_json],
        input=compose(*args, "config", file=file, **variables),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    data = json.loads(done.stdout)
    return data


def _without_ours(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment without the variables compose.yaml reads: what the file says is under test."""
    return {k: v for k, v in environ.items() if not k.startswith(("RESERVATIONS_", "COMPOSE_"))}
