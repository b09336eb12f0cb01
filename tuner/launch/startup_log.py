"""Start-up facts from a vLLM log: the figures the study calibrates its feasibility filter with."""

from __future__ import annotations

import re

from tuner.launch.base import StartupFacts

_NUMBER = r"(\d[\d,]*(?:\.\d+)?)"
_WEIGHTS = re.compile(rf"Model loading took {_NUMBER} GiB(?: memory)? and {_NUMBER} s(?:econds)?")
_KV_MEMORY = re.compile(rf"Available KV cache memory: {_NUMBER} GiB")
_KV_TOKENS = re.compile(rf"GPU KV cache size: {_NUMBER} tokens")
_CONCURRENCY = re.compile(rf"Maximum concurrency for {_NUMBER} tokens per request: {_NUMBER}x")


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _last(pattern: re.Pattern[str], log: str) -> re.Match[str] | None:
    matches = list(pattern.finditer(log))
    return matches[-1] if matches else None


def parse_startup_facts(log: str, *, startup_seconds: float | None = None) -> StartupFacts:
    """The last value of each start-up line (with tensor parallelism every worker prints its own, alike)."""
    weights = _last(_WEIGHTS, log)
    kv_memory = _last(_KV_MEMORY, log)
    kv_tokens = _last(_KV_TOKENS, log)
    concurrency = _last(_CONCURRENCY, log)
    return StartupFacts(
        kv_tokens=int(_num(kv_tokens.group(1))) if kv_tokens else None,
        max_concurrency=_num(concurrency.group(2)) if concurrency else None,
        weights_gib=_num(weights.group(1)) if weights else None,
        available_kv_gib=_num(kv_memory.group(1)) if kv_memory else None,
        startup_seconds=startup_seconds,
        weights_load_seconds=_num(weights.group(2)) if weights else None,
        max_model_len=int(_num(concurrency.group(1))) if concurrency else None,
    )


def has_capacity_lines(log: str) -> bool:
    return _KV_TOKENS.search(log) is not None
