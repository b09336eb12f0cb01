"""Where the conformance fixtures live and how they are written and read: one directory per vLLM version, each
file stamped with the version it was recorded from, so a moved pin without re-recorded fixtures fails loudly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tuner.vllm_pin import PINNED_VLLM

FILES = ("server", "http", "metrics", "startup")


def fixture_dir(root: Path, version: str = PINNED_VLLM) -> Path:
    return root / f"vllm-{version}"


def write_fixture(directory: Path, name: str, version: str, data: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"vllm_version": version, **data}, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_fixture(directory: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / f"{name}.json").read_text(encoding="utf-8"))
    return data
