"""A trace played back: the slice sent (its send times from the slice's start, divided by the speed-up), the
prompts written so that Mooncake's shared hash ids are shared prompt text, and the slice's shape for the dry run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tuner.load.prompt_fit import UNFITTED, PromptFit
from tuner.load.traces import Trace, TraceRequest
from tuner.load.workload import ChatApi, PromptSpec

__all__ = [
    "SliceShape",
    "TimedRequest",
    "mean_rate",
    "reusable_tokens",
    "slice_shape",
    "trace_prompts",
    "trace_slice",
]


@dataclass(frozen=True)
class TimedRequest:
    send_s: float
    """When to send it: seconds from the start of the replay (the slice's start, after the speed-up)."""
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def trace_slice(
    trace: Trace, start_s: float = 0.0, duration_s: float | None = None, speedup: float = 1.0
) -> tuple[TimedRequest, ...]:
    """The requests of [start_s, start_s + duration_s) of the trace's own time, sent at (t - start_s) / speedup."""
    end = math.inf if duration_s is None else start_s + duration_s
    return tuple(
        TimedRequest((r.t_s - start_s) / speedup, r.input_len, r.output_len, r.hash_ids)
        for r in trace.requests
        if start_s <= r.t_s < end
    )


def mean_rate(requests: Sequence[TimedRequest]) -> float | None:
    """Requests per second between the first send and the last: (n - 1) gaps over their span, so the slice played
    k times faster sends at exactly k times this. None for fewer than two requests or all at one instant."""
    if len(requests) < 2:
        return None
    span = requests[-1].send_s - requests[0].send_s
    return (len(requests) - 1) / span if span > 0 else None


def trace_prompts(
    requests: Sequence[TimedRequest | TraceRequest],
    fit: PromptFit | None = None,
    *,
    api: ChatApi = "completions",
    block_tokens: int = 512,
    seed: int = 0,
) -> Iterator[PromptSpec]:
    """One prompt a request, of its input length: the blocks of its hash ids (the same tokens wherever an id is
    shared), cut to the length, then tokens of its own (drawn afresh: no other request shares them)."""
    fit = fit or UNFITTED
    chat = api == "chat"
    pool: Sequence[int | str] = list(fit.words) if chat else list(fit.ids)
    blocks: dict[int, list[int | str]] = {}
    fresh = random.Random(f"trace-tokens-{seed}")
    for req in requests:
        # A chat template adds its own tokens around the text: the text is that much shorter.
        n_text = max(1, req.input_len - fit.chat_overhead) if chat else req.input_len
        tokens: list[int | str] = []
        for h in req.hash_ids:
            if len(tokens) >= n_text:
                break
            if h not in blocks:
                rng = random.Random(f"trace-block-{seed}-{h}")
                blocks[h] = [rng.choice(pool) for _ in range(block_tokens)]
            tokens.extend(blocks[h])
        tokens = tokens[:n_text]
        tokens.extend(fresh.choice(pool) for _ in range(n_text - len(tokens)))
        if chat:
            text = " ".join(str(w) for w in tokens)
            yield PromptSpec(prompt=text, prompt_len=n_text + fit.chat_overhead, output_len=req.output_len)
        else:
            yield PromptSpec(prompt=[int(t) for t in tokens], prompt_len=n_text, output_len=req.output_len)


def reusable_tokens(requests: Sequence[TimedRequest | TraceRequest], block_tokens: int = 512) -> list[int]:
    """Each request's prompt tokens a prefix cache could serve: its leading blocks whose ids an earlier request of
    the slice sent (a cache hit is a prefix, so the first unseen id ends it), no more than its input length."""
    seen: set[int] = set()
    out = []
    for req in requests:
        leading = 0
        for h in req.hash_ids:
            if h not in seen:
                break
            leading += 1
        out.append(min(leading * block_tokens, req.input_len))
        seen.update(req.hash_ids)
    return out


@dataclass(frozen=True)
class SliceShape:
    requests: int
    span_s: float
    bucket_s: int
    counts: list[int]
    """Requests sent in each `bucket_s` of the replay."""
    input_pct: dict[int, int]
    output_pct: dict[int, int]
    reusable_share: float | None
    """Of all prompt tokens, the share a prefix cache could serve; None without hash ids."""
    rate: float | None = None
    """Its mean rate (`mean_rate`): what a rate search divides a probed rate by to get the speed-up."""

    def lines(self) -> list[str]:
        rate = f"{self.rate:.2f} req/s on average" if self.rate is not None else "no rate: one instant"
        pct = "  ".join(f"p{p} {self.input_pct[p]}/{self.output_pct[p]}" for p in self.input_pct)
        out = [
            f"trace slice: {self.requests} requests over {self.span_s:.0f} s of replay ({rate})",
            f"  requests per {_span(self.bucket_s)}: {sparkline(self.counts)}  (min {min(self.counts)}, "
            f"max {max(self.counts)})",
            f"  input/output tokens: {pct}",
        ]
        if self.reusable_share is not None:
            out.append(f"  prompt tokens reusable (shared hash ids): {self.reusable_share:.0%}")
        return out


_PERCENTILES = (50, 90, 99)


def slice_shape(requests: Sequence[TimedRequest], block_tokens: int = 512) -> SliceShape:
    """What the dry run prints: the count, the sends over time, the lengths' percentiles, the reuse."""
    span = max((r.send_s for r in requests), default=0.0)
    # the shortest bucket that gives a bar each at most: a few minutes' replay by 10 s, a day's by the hour
    bucket = next((b for b in _BUCKETS_S if span / b < _WIDTH), _BUCKETS_S[-1])
    counts = [0] * (int(span // bucket) + 1)
    for r in requests:
        counts[int(r.send_s // bucket)] += 1
    inputs = sorted(r.input_len for r in requests)
    outputs = sorted(r.output_len for r in requests)
    share = None
    if any(r.hash_ids for r in requests):
        share = sum(reusable_tokens(requests, block_tokens)) / max(1, sum(inputs))
    return SliceShape(
        requests=len(requests),
        span_s=span,
        bucket_s=bucket,
        counts=counts,
        input_pct={p: _percentile(inputs, p) for p in _PERCENTILES},
        output_pct={p: _percentile(outputs, p) for p in _PERCENTILES},
        reusable_share=share,
        rate=mean_rate(requests),
    )


def _percentile(values: Sequence[int], p: int) -> int:
    """Nearest rank: a value the slice holds."""
    if not values:
        return 0
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]


_BARS = "▁▂▃▄▅▆▇█"
_WIDTH = 40
_BUCKETS_S = (1, 10, 60, 600, 3600)


def _span(seconds: int) -> str:
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min" if seconds < 3600 else f"{seconds // 3600} h"


def sparkline(counts: Sequence[int]) -> str:
    """Counts as bars, at most 40 wide (neighbouring counts summed into one bar beyond that)."""
    if not counts:
        return ""
    per = math.ceil(len(counts) / _WIDTH)
    sums = [sum(counts[i : i + per]) for i in range(0, len(counts), per)]
    top = max(sums) or 1
    return "".join(_BARS[min(len(_BARS) - 1, (len(_BARS) - 1) * s // top)] for s in sums)
