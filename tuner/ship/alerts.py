"""Alert rules on vLLM's metric names, with thresholds from the study's SLOs and what the winner held at capacity.

One rule list, two wrappers: a plain Prometheus rules file (what `promtool check rules` reads) and the same groups
in a prometheus-operator `PrometheusRule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from tuner.errors import ConfigError
from tuner.scoring import Figure, Slo, parse_slo

__all__ = ["alert_rules", "latency_expr", "prometheus_rule", "rules_file"]


def alert_rules(slos: Sequence[str], *, queue_at_capacity: float, name: str = "vllm") -> list[dict[str, Any]]:
    """The rules: latencies over their SLO (each on the vLLM histogram the registry names, at the SLO's own
    quantile), queue above the winner's at capacity, KV cache nearly full, preemptions, errors against the
    success-rate SLO, server down."""
    job = f'job="{name}"'
    return [*_slo_rules([_parse(s) for s in slos], job), *_health_rules(job, queue_at_capacity)]


def _slo_rules(parsed: Sequence[Slo], job: str) -> list[dict[str, Any]]:
    """A latency SLO's rule on its vLLM histogram, and the success-rate SLO's on the aborted requests."""
    rules: list[dict[str, Any]] = []
    for slo in parsed:
        figure = Figure.named(slo.metric)
        expr = latency_expr(figure, job) if figure is not None and slo.op in ("<=", "<") else None
        if figure is not None and expr is not None:
            rules.append(
                _rule(
                    f"VllmSlo{slo.metric.title().replace('_', '')}",
                    f"{expr} > {slo.threshold:g}",
                    "10m",
                    "warning",
                    f"{figure.entry.long_label} {figure.stat.upper()} is over the SLO {slo} the flags were tuned for.",
                    "Load is above the planned capacity: add replicas (check the HPA's max) or shed load; "
                    "rerun `tuner plan` with the current rate.",
                )
            )
        if slo.metric == "success_rate" and slo.op in (">=", ">"):
            errors = 1 - slo.threshold
            expr = (
                f'sum(rate(vllm:request_success_total{{{job},finished_reason="abort"}}[5m])) / '
                f"sum(rate(vllm:request_success_total{{{job}}}[5m])) > {errors:g}"
            )
            rules.append(
                _rule(
                    "VllmErrorRate",
                    expr,
                    "10m",
                    "critical",
                    f"More than {errors:.2%} of requests fail (the SLO: {slo}).",
                    "Read the server log for the failures (out of memory, timeouts, aborts); scale out if overloaded.",
                )
            )
    return rules


def _health_rules(job: str, queue_at_capacity: float) -> list[dict[str, Any]]:
    """The rules every deployment gets: the queue past the planned capacity, the KV cache full, preemptions, down."""
    return [
        _rule(
            "VllmQueueAboveCapacity",
            f"max(vllm:num_requests_waiting{{{job}}}) > {queue_at_capacity:g}",
            "5m",
            "warning",
            f"More requests wait than the winner held at its measured capacity ({queue_at_capacity:g}).",
            "The server is past the rate it was planned for: latency SLOs are next; add replicas.",
        ),
        _rule(
            "VllmKvCacheFull",
            f"max(vllm:kv_cache_usage_perc{{{job}}}) > 0.9",
            "5m",
            "warning",
            "KV cache usage has been over 90% for minutes: new requests wait and running ones get preempted.",
            "Lower max_num_seqs, raise gpu_memory_utilization, or add replicas.",
        ),
        _rule(
            "VllmPreemptions",
            f"sum(rate(vllm:num_preemptions_total{{{job}}}[5m])) > 0",
            "5m",
            "warning",
            "The scheduler preempts requests (KV cache exhausted): their work is recomputed and latency grows.",
            "Lower max_num_seqs or max_num_batched_tokens, or add replicas.",
        ),
        _rule(
            "VllmDown",
            f"up{{{job}}} == 0",
            "2m",
            "critical",
            "A vLLM server does not answer Prometheus's scrape.",
            "Check the pod (kubectl describe / logs): out of memory at start-up, a failed model download, a crash.",
        ),
    ]


def latency_expr(figure: Figure, job: str, window: str = "5m") -> str | None:
    """PromQL for a latency figure from the vLLM histogram that answers its metric: a percentile at its own
    quantile, a mean as sum over count; None when vLLM has no histogram for it or the statistic (max) is not one a
    histogram answers."""
    histogram = figure.entry.histogram
    if histogram is None:
        return None
    if figure.stat == "mean":
        return f"sum(rate({histogram}_sum{{{job}}}[{window}])) / sum(rate({histogram}_count{{{job}}}[{window}]))"
    if figure.quantile is None:
        return None
    return f"histogram_quantile({figure.quantile:g}, sum by (le) (rate({histogram}_bucket{{{job}}}[{window}])))"


def rules_file(rules: list[dict[str, Any]], *, group: str = "vllm-slo") -> str:
    return yaml.safe_dump({"groups": [{"name": group, "rules": rules}]}, sort_keys=False, width=120)


def prometheus_rule(rules: list[dict[str, Any]], *, name: str = "vllm", group: str = "vllm-slo") -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": f"{name}-alerts", "labels": {"app": name}},
        "spec": {"groups": [{"name": group, "rules": rules}]},
    }


def _rule(alert: str, expr: str, for_: str, severity: str, summary: str, action: str) -> dict[str, Any]:
    return {
        "alert": alert,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "action": action},
    }


def _parse(text: str) -> Slo:
    try:
        return parse_slo(text)
    except ConfigError as e:
        raise ConfigError(f"the study's SLO {text!r} does not read: {e}") from None
