"""Start-up facts from a vLLM log: the figures the study calibrates its feasibility filter with.

The wordings differ by version and device; each pattern reads every form seen in vLLM's source and real logs:
- KV tokens: older releases print "GPU KV cache size: N tokens" and "Maximum concurrency for L tokens per request:
  Cx" as two lines, later ones as one line, and 0.32 puts the device's name in front ("CPU KV cache size", "XPU
  ...", "GPU + host ..."); the CPU build said "GPU" as late as 0.29.
- KV memory: GPU "Available KV cache memory: X GiB"; CPU "Explicitly set (X/TOTAL) GiB for KV cache on node 0."
  (VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes) or "Auto set (X/TOTAL) GiB for KV cache on node 0, with ...".
  Older CPU builds print neither.
- Weights: GPU "Model loading took X GiB [memory] and Y seconds"; the CPU build prints no memory figure, only
  "Loading weights took Y seconds" (which the GPU build prints too, before its fuller line).
- CUDA graphs: "Estimated CUDA graph memory: X GiB total" (GPUModelRunner.profile_cudagraph_memory, 0.21+: taken out
  of the KV budget); eager and CPU starts print none.
- Version: the banner "vLLM API server version X" (v0.11 and before), "vLLM server version X, serving model M", or
  the logo's "version X" (wrapped in ANSI colour codes on a terminal).
"""

from __future__ import annotations

import re

from tuner.launch.base import StartupFacts

_NUMBER = r"(\d[\d,]*(?:\.\d+)?)"
_WEIGHTS = re.compile(rf"Model loading took {_NUMBER} GiB(?: memory)? and {_NUMBER} s(?:econds)?")
_WEIGHTS_SECONDS = re.compile(rf"Loading weights took {_NUMBER} s(?:econds)?")
_KV_MEMORY = re.compile(
    rf"(?:Available KV cache memory: {_NUMBER} GiB|(?:Explicitly|Auto) set \({_NUMBER}/[\d.]+\) GiB for KV cache)"
)
_KV_TOKENS = re.compile(rf"KV cache size: {_NUMBER} tokens")
_CONCURRENCY = re.compile(rf"Maximum concurrency for {_NUMBER} tokens per request: {_NUMBER}x")
_GRAPHS = re.compile(rf"Estimated CUDA graph memory: {_NUMBER} GiB total")
_ENGINE_INIT = re.compile(rf"init engine \(profile, create kv cache, warmup model\) took {_NUMBER} s")
_ANSI = r"(?:\x1b\[[\d;]*m)*"
_VERSION = re.compile(rf"(?:vLLM (?:API )?server version|█{_ANSI} +version) +{_ANSI}(\d+\.\d+[\w.+-]*)")

# Every line the launchers read, by the fact it gives: the conformance fixtures record these lines from real vLLM
# (tuner/conformance) and check that the emulator prints each where vLLM does.
STARTUP_LINES: dict[str, re.Pattern[str]] = {
    "version": _VERSION,
    "weights": _WEIGHTS,
    "weights_seconds": _WEIGHTS_SECONDS,
    "kv_memory": _KV_MEMORY,
    "kv_tokens": _KV_TOKENS,
    "concurrency": _CONCURRENCY,
    "engine_init": _ENGINE_INIT,
}


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _last(pattern: re.Pattern[str], log: str) -> re.Match[str] | None:
    matches = list(pattern.finditer(log))
    return matches[-1] if matches else None


def _first_group(match: re.Match[str] | None) -> str | None:
    """The first group that matched: a pattern with alternatives captures in one of them."""
    if match is None:
        return None
    return next((g for g in match.groups() if g is not None), None)


def _float(match: re.Match[str] | None) -> float | None:
    value = _first_group(match)
    return _num(value) if value is not None else None


def parse_startup_facts(log: str, *, startup_seconds: float | None = None) -> StartupFacts:
    """The last value of each start-up line (with tensor parallelism every worker prints its own, alike)."""
    weights = _last(_WEIGHTS, log)
    kv_tokens = _float(_last(_KV_TOKENS, log))
    concurrency = _last(_CONCURRENCY, log)
    return StartupFacts(
        kv_tokens=int(kv_tokens) if kv_tokens is not None else None,
        max_concurrency=_num(concurrency.group(2)) if concurrency else None,
        weights_gib=_num(weights.group(1)) if weights else None,
        available_kv_gib=_float(_last(_KV_MEMORY, log)),
        startup_seconds=startup_seconds,
        weights_load_seconds=_num(weights.group(2)) if weights else _float(_last(_WEIGHTS_SECONDS, log)),
        max_model_len=int(_num(concurrency.group(1))) if concurrency else None,
        engine_init_seconds=_float(_last(_ENGINE_INIT, log)),
        vllm_version=log_version(log),
        cuda_graph_gib=_float(_last(_GRAPHS, log)),
    )


def log_version(log: str) -> str | None:
    """The version the server's banner names, or None (a server that printed none, or not vLLM)."""
    return _first_group(_VERSION.search(log))


def has_capacity_lines(log: str) -> bool:
    return _KV_TOKENS.search(log) is not None
