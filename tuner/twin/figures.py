"""The figures the twin is judged on: the throughput and every SLO's metric, predicted and measured alike.

The study decides a trial by its SLO verdict, so the twin is compared with a real trial on the same terms: each SLO
metric's value (seconds for a latency, a fraction for the success rate), the verdict they give, and the throughput.
A prediction carries its uncertainty per figure (a log-normal spread learnt from the refit's residuals), so a flag
set predicted to meet an SLO by less than that spread has a chance of meeting it, not a certainty.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tuner.scoring import NO_DATA_VIOLATION, LoadSummary, Slo, latency_of

__all__ = [
    "THROUGHPUT",
    "chance_of_meeting",
    "describe_miss",
    "describe_surprise",
    "figures_of",
    "measured_slo_values",
    "slo_value",
    "violation_of",
]

THROUGHPUT = "output_tok_s"
FAILURE_SHARES = frozenset({"success_rate"})  # shares of requests bounded by 1: their spread is in the failures


def figures_of(summary: LoadSummary, slos: Sequence[Slo], scale: float = 1.0) -> dict[str, float]:
    """The throughput and each SLO's metric of `summary` with every duration times `scale` (a latency grows with
    it, a rate shrinks; the success rate does not move)."""
    out = {THROUGHPUT: float(summary.output_throughput) / scale}
    for slo in slos:
        latency = latency_of(slo.metric)  # the registry's reading: a metric's name may hold an underscore
        if latency is not None and getattr(summary, latency[0].name).count == 0:
            continue  # nothing measured: no figure (the verdict counts it as a miss)
        out[slo.metric] = slo_value(slo, slo.value(summary), scale)
    return out


def slo_value(slo: Slo, value: float, scale: float) -> float:
    if slo.is_latency:
        return value * scale
    return value if slo.metric == "success_rate" else value / scale


def violation_of(slo: Slo, figures: Mapping[str, float]) -> float:
    """The SLO's relative violation (Optuna's constraint: <= 0 met) read from the figures, as `Slo.violation`
    reads it from a summary; a figure not there was not measured: a certain miss."""
    value = figures.get(slo.metric)
    if value is None:
        return NO_DATA_VIOLATION
    scale = abs(slo.threshold) if slo.threshold != 0 else 1.0
    excess = value - slo.threshold if slo.op in ("<=", "<") else slo.threshold - value
    return excess / scale


def chance_of_meeting(slos: Sequence[Slo], figures: Mapping[str, float], sigma: Mapping[str, float]) -> float:
    """The chance that every SLO is met, each figure log-normal around its prediction with its spread (a metric
    without a spread is taken as certain). The SLOs are taken as independent: the product of their chances."""
    chance = 1.0
    for slo in slos:
        value = figures.get(slo.metric)
        s = sigma.get(slo.metric, 0.0)
        if value is None or value <= 0 or slo.threshold <= 0 or s <= 0:
            chance *= 1.0 if violation_of(slo, figures) <= 0 else 0.0
            continue
        margin = _margin(slo, value)
        if margin == math.inf:
            continue
        chance *= 0.5 * (1.0 + math.erf(margin / (s * math.sqrt(2.0))))
    return chance


def _margin(slo: Slo, value: float) -> float:
    """How far (in logs) a predicted figure is inside its SLO. A share of requests (the success rate) spreads in
    what fails, not in what succeeds: a run simulated with every request answered meets `>= 0.99` whatever the
    spread, where a spread on the rate itself would put a near coin-toss on a 1% margin and let it outweigh the
    throughput in the ranking."""
    if slo.metric in FAILURE_SHARES and slo.op in (">=", ">") and slo.threshold < 1.0:
        failing = 1.0 - value
        return math.inf if failing <= 0 else math.log((1.0 - slo.threshold) / failing)
    return math.log(slo.threshold / value) if slo.op in ("<=", "<") else math.log(value / slo.threshold)


def measured_slo_values(slos: Sequence[Slo], names: Sequence[str], violations: Sequence[float]) -> dict[str, float]:
    """Each SLO metric's measured value, from a trial record's constraints (`slo:<slo>` -> its relative violation,
    which the study stores for every measured trial whatever metric the SLO names)."""
    by_name = dict(zip(names, violations, strict=False))
    out: dict[str, float] = {}
    for slo in slos:
        v = by_name.get(f"slo:{slo}")
        if v is None or abs(v) >= NO_DATA_VIOLATION:
            continue
        scale = abs(slo.threshold) if slo.threshold != 0 else 1.0
        out[slo.metric] = slo.threshold + v * scale if slo.op in ("<=", "<") else slo.threshold - v * scale
    return out


def describe_miss(slos: Sequence[Slo], measured: Mapping[str, float], predicted: Mapping[str, float]) -> str:
    """The SLOs a trial missed, with the twin's figure beside each: `e2e_p95 (48.1 s > 46 s): predicted 44.2 s`."""
    parts = []
    for slo in slos:
        if violation_of(slo, measured) <= 0:
            continue
        value = measured.get(slo.metric)
        got = "no data" if value is None else f"{_show(slo, value)} {_opposite(slo.op)} {_show(slo, slo.threshold)}"
        twin = predicted.get(slo.metric)
        parts.append(f"{slo.metric} ({got})" + ("" if twin is None else f": predicted {_show(slo, twin)}"))
    return "; ".join(parts)


def describe_surprise(slos: Sequence[Slo], measured: Mapping[str, float], predicted: Mapping[str, float]) -> str:
    """The SLOs a trial met that the twin predicted it would miss: `ttft_p95 36.7 s (predicted 40.7 s > 40 s)`."""
    parts = []
    for slo in slos:
        if violation_of(slo, predicted) <= 0 or violation_of(slo, measured) > 0:
            continue
        twin = predicted.get(slo.metric)
        said = "no data" if twin is None else f"{_show(slo, twin)} {_opposite(slo.op)} {_show(slo, slo.threshold)}"
        parts.append(f"{slo.metric} {_show(slo, measured[slo.metric])} (predicted {said})")
    return "; ".join(parts)


def _opposite(op: str) -> str:
    return {"<=": ">", "<": ">=", ">=": "<", ">": "<="}[op]


def _show(slo: Slo, value: float) -> str:
    if slo.is_latency:
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"
    return f"{value:.3g}"
