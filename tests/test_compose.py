"""The reference deployment file stays valid and keeps the settings that make redelivery safe."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_compose_file_is_valid() -> None:
    done = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "compose.yaml"), "config"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    for needle in ("appendonly", "appendfsync", "service_completed_successfully", "celery"):
        assert needle in done.stdout
