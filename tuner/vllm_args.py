"""The arguments of `vllm serve` in the pinned vLLM, recorded by scripts/record-vllm-args into tuner/data/.

A job's flag keys are checked against them before anything launches: a typo'd key would otherwise reach vLLM on
every trial (and fail every start) or, for the emulator, be silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from tuner.vllm_pin import PINNED_VLLM


@dataclass(frozen=True)
class VllmArg:
    """One option: `kind` is switch (--x/--no-x), switch_on (--x only), int, float or value; `choices` if listed."""

    name: str
    kind: str
    choices: tuple[Any, ...] | None = None


@cache
def vllm_args(version: str = PINNED_VLLM) -> dict[str, VllmArg]:
    """Underscored option name -> VllmArg, for a recorded vLLM version (KeyError if it was never recorded)."""
    path = resources.files("tuner") / "data" / f"vllm-{version}-args.json"
    if not path.is_file():
        raise KeyError(version)
    data = json.loads(path.read_text(encoding="utf-8"))
    return {
        name: VllmArg(name, entry["kind"], tuple(entry["choices"]) if "choices" in entry else None)
        for name, entry in data["args"].items()
    }


__all__ = ["VllmArg", "vllm_args"]
