"""Alert rules on vLLM's metric names, with thresholds from the study's SLOs and what the winner held at capacity.

One rule list, two wrappers: a plain Prometheus rules file (what `promtool check rules` reads) and the same groups
in a prometheus-operator `PrometheusRule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from tuner.errors import ConfigError
from tuner.scoring import Slo, parse_slo

__all__ = ["alert_rules", "prometheus_rule", "rules_file"]

# The SLO metrics a vLLM histogram answers, and that histogram's name.
_HISTOGRAMS = {
    "ttft_p95": ("vllm:time_to_first_token_seconds_bucket", "TTFT"),
    "e2e_p95": ("vllm:e2e_request_latency_seconds_bucket", "End-to-end latency"),
}


def alert_rules(slos: Sequence[str], *, queue_at_capacity: float, name: str = "vllm") -> list[dict[str, Any]]:
    """The rules: latency P95s over their SLO, queue above the winner's at capacity, KV cache nearly full,
    preemptions, errors against the success-rate SLO, server down."""
    job = f'job="{name}"'
    rules: list[dict[str, Any]] = []
    parsed = [_parse(s) for s in slos]
    for slo in parsed:
        if slo.metric in _HISTOGRAMS and slo.op in ("<=", "<"):
            bucket, label = _HISTOGRAMS[slo.metric]
            expr = f"histogram_quantile(0.95, sum by (le) (rate({bucket}{{{job}}}[5m]))) > {slo.threshold:g}"
            rules.append(
                _rule(
                    f"VllmSlo{slo.metric.title().replace('_', '')}",
                    expr,
                    "10m",
                    "warning",
                    f"{label} P95 is over the SLO {slo} the flags were tuned for.",
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
    rules += [
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
    return rules


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
