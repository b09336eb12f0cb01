"""A Grafana dashboard for the deployment: throughput, latency percentiles with the SLO drawn, KV cache, queue,
preemptions; on vLLM's metric names, the Prometheus data source chosen on import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tuner.scoring import Figure, latency_metrics, parse_slo
from tuner.ship.alerts import latency_expr

__all__ = ["dashboard"]

_DRAWN = ("p50", "p95", "p99")  # the percentiles each latency panel plots


def dashboard(name: str, slos: Sequence[str], *, queue_at_capacity: float) -> dict[str, Any]:
    job = f'job="{name}"'
    bounds = {s.metric: s.threshold for s in map(parse_slo, slos)}
    panels = [
        _panel(
            "Throughput",
            [
                (f"sum(rate(vllm:generation_tokens_total{{{job}}}[1m]))", "output tok/s"),
                (f"sum(rate(vllm:request_success_total{{{job}}}[1m]))", "requests/s"),
            ],
            "short",
        )
    ]
    for metric in latency_metrics():
        drawn = [Figure(metric.name, stat) for stat in _DRAWN]
        queries = [(q, f.stat.upper()) for f in drawn if (q := latency_expr(f, job)) is not None]
        if queries:
            # The bound drawn: the metric's P95 SLO as before, else any percentile SLO on it.
            bound = next((bounds[f.name] for f in (drawn[1], drawn[0], drawn[2]) if f.name in bounds), None)
            panels.append(_panel(f"{metric.long_label} percentiles", queries, "s", bound=bound))
    panels += [
        _panel("KV cache usage", [(f"vllm:kv_cache_usage_perc{{{job}}}", "{{instance}}")], "percentunit", bound=0.9),
        _panel(
            "Queue (waiting requests)",
            [(f"vllm:num_requests_waiting{{{job}}}", "{{instance}}")],
            "short",
            bound=queue_at_capacity,
        ),
        _panel("Preemptions / s", [(f"sum(rate(vllm:num_preemptions_total{{{job}}}[5m]))", "preemptions/s")], "short"),
    ]
    for i, panel in enumerate(panels):
        panel |= {"id": i + 1, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)}}
    return {
        "title": f"vLLM {name}",
        "uid": f"tuner-{name}"[:40],
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


def _panel(title: str, queries: list[tuple[str, str]], unit: str, *, bound: float | None = None) -> dict[str, Any]:
    """A time series; `bound` (an SLO, or what the winner held) drawn as a red threshold line."""
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if bound is not None:
        steps.append({"color": "red", "value": bound})
    return {
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "targets": [{"expr": e, "legendFormat": legend, "refId": "ABC"[i]} for i, (e, legend) in enumerate(queries)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {"mode": "absolute", "steps": steps},
                "custom": {"thresholdsStyle": {"mode": "line" if bound is not None else "off"}},
            },
            "overrides": [],
        },
    }
