"""A short probe of a real server: a few closed-loop load points through tuner's own load client, and what the
server says about itself (its vLLM version, model, context limit, KV blocks and block size)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tuner.calibration.fit import LoadPoint, Measured
from tuner.errors import TunerError
from tuner.load import Arrival, RequestRecord, Workload, run_load
from tuner.load.runner import new_client

__all__ = ["DEFAULT_POINTS", "ServerFacts", "measure_point", "probe_points", "server_facts"]


def default_points(
    concurrency: Sequence[int] = (1, 4, 16),
    input_lens: Sequence[int] = (128, 512),
    output_len: int = 32,
    rounds: int = 4,
) -> list[LoadPoint]:
    """Each concurrency at each prompt length: the overhead, per-sequence cost and request latency from the
    concurrencies, the prefill and context costs from the lengths. A warm-up round (at least 2 requests) first,
    then `rounds` rounds measured (at least 16 requests, so one slow request on a busy machine weighs little)."""
    return [
        LoadPoint(concurrency=c, input_len=n, output_len=output_len, requests=max(16, rounds * c), warmup=max(2, c))
        for n in input_lens
        for c in concurrency
    ]


DEFAULT_POINTS = default_points()


@dataclass(frozen=True)
class ServerFacts:
    model: str  # the served name
    root: str | None  # what the server loaded (a path or hub id), from /v1/models
    max_model_len: int | None
    vllm_version: str | None
    block_size: int | None  # vllm:cache_config_info
    num_gpu_blocks: int | None


async def server_facts(client: httpx.AsyncClient, base_url: str, model: str | None) -> ServerFacts:
    """Ask the server what it serves; TunerError (one line) when it is not a vLLM-like server."""
    base = base_url.rstrip("/")
    try:
        response = await client.get(f"{base}/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise TunerError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    try:
        models = response.json()["data"]
    except (ValueError, KeyError, TypeError) as e:
        raise TunerError(
            f"{base}/v1/models did not answer as vLLM does ({type(e).__name__}): is it a vLLM server?"
        ) from None
    entry = next((m for m in models if model is None or m.get("id") == model), None)
    if entry is None:
        served = ", ".join(str(m.get("id")) for m in models)
        raise TunerError(f"--model {model!r}: the server serves {served}")
    version: str | None = None
    try:
        version = (await client.get(f"{base}/version")).json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        version = None
    block_size = blocks = None
    try:
        text = (await client.get(f"{base}/metrics")).text
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:cache_config_info":
                labels = family.samples[0].labels
                block_size = _int(labels.get("block_size"))
                blocks = _int(labels.get("num_gpu_blocks"))
    except (httpx.HTTPError, ValueError, IndexError):
        pass
    return ServerFacts(
        model=str(entry["id"]),
        root=entry.get("root"),
        max_model_len=_int(entry.get("max_model_len")),
        vllm_version=version,
        block_size=block_size,
        num_gpu_blocks=blocks,
    )


def _int(value: object) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def measured(records: Sequence[RequestRecord]) -> Measured:
    """The means the fit compares with: over the measured (not warm-up) requests that succeeded."""
    ok = [r for r in records if r.ok and not r.warmup and r.ttft_s is not None]
    if not ok:
        failures = {r.error_class for r in records if not r.ok}
        raise TunerError(f"no request of the probe succeeded ({', '.join(sorted(map(str, failures))) or 'none sent'})")
    multi = [r for r in ok if r.completion_tokens > 1]
    return Measured(
        ttft_mean_s=sum(r.ttft_s or 0.0 for r in ok) / len(ok),
        tpot_mean_s=(
            sum((r.e2e_s - (r.ttft_s or 0.0)) / (r.completion_tokens - 1) for r in multi) / len(multi) if multi else 0.0
        ),
        duration_s=max(r.end_s for r in ok) - min(r.start_s for r in ok),
        output_tokens=sum(r.completion_tokens for r in ok),
    )


async def measure_point(client: httpx.AsyncClient, base_url: str, model: str, point: LoadPoint) -> Measured:
    p = point
    workload = Workload(input_len=p.input_len, output_len=p.output_len, api="completions", seed=p.concurrency)
    arrival = Arrival(concurrency=point.concurrency, requests=point.requests, warmup_requests=point.warmup)
    result = await run_load(base_url, model, workload, arrival, client=client, scrape_metrics=False)
    return measured(result.records)


async def probe_points(
    base_url: str,
    model: str | None,
    points: Sequence[LoadPoint],
    on_point: Callable[[LoadPoint, Measured], None] | None = None,
) -> tuple[ServerFacts, list[tuple[LoadPoint, Measured]]]:
    """The server's facts and each point's measurement, in order."""
    async with new_client() as client:
        facts = await server_facts(client, base_url, model)
        out: list[tuple[LoadPoint, Measured]] = []
        for p in points:
            if facts.max_model_len is not None and p.input_len + p.output_len > facts.max_model_len:
                raise TunerError(
                    f"load point {p.input_len}+{p.output_len} tokens exceeds the server's max_model_len "
                    f"({facts.max_model_len}): probe shorter prompts (--input-len)"
                )
            m = await measure_point(client, base_url, facts.model, p)
            out.append((p, m))
            if on_point is not None:
                on_point(p, m)
    return facts, out


def decode_unseen(measured: Sequence[Measured]) -> str | None:
    """Why the probe could not time a decode step, if it could not: every reply reached the client in one piece (a
    server too busy to stream sends its tokens together), so TPOT read 0 at every point."""
    if any(m.tpot_mean_s > 0 for m in measured):
        return None
    return (
        "warning: every reply came in one piece (TPOT 0 at every point): the server sent its tokens together, so a "
        "decode step's cost is fitted from throughput alone; probe again with a longer --output-len or on a quieter "
        "machine"
    )
