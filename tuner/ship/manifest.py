"""A capacity plan as Kubernetes objects: the autoscaler and the alert rules that ship beside the Deployment.

`tuner plan --manifest` and `tuner export --format kubernetes --plan R` write the same stream from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner.export import DeployOptions, Provenance, kubernetes_with
from tuner.flags import VllmFlags
from tuner.report.views import StudyView, TrialView
from tuner.ship.alerts import alert_rules, prometheus_rule
from tuner.ship.hpa import autoscaler
from tuner.ship.measure import MeasuredCapacity
from tuner.ship.plan import Plan, make_plan

__all__ = ["PlanInputs", "planned_kubernetes", "queue_at_capacity", "tokens_per_request"]


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is asked for: the rate (and peak) to serve and the share of measured capacity to plan on."""

    rate: float
    peak: float | None = None
    headroom: float = 0.7
    price_per_gpu_hour: float | None = None
    measured: MeasuredCapacity | None = None  # `--measure`: the rate searched now, not the stored one
    lower_bound: bool = False  # `--lower-bound`: the pooled rate's lower 95% bound, not its value

    def plan(self, view: StudyView, t: TrialView, detail: Any) -> Plan:
        m = self.measured
        return make_plan(
            view,
            t,
            rate=self.rate,
            peak=self.peak,
            headroom=self.headroom,
            price_per_gpu_hour=self.price_per_gpu_hour,
            tokens_per_request=(m.tokens_per_request if m else None) or tokens_per_request(detail),
            measured=(m.rate, m.basis) if m else None,
            lower_bound=self.lower_bound,
        )


def planned_kubernetes(
    view: StudyView,
    t: TrialView,
    detail: Any,
    inputs: PlanInputs,
    *,
    flags: VllmFlags,
    options: DeployOptions,
    provenance: Provenance | None,
    name: str,
) -> tuple[Plan, str]:
    """The Deployment at the plan's replicas, its Service, an HPA on vLLM's queue between the plan's replicas and its
    peak replicas, and the PrometheusRule of the study's SLOs."""
    plan = inputs.plan(view, t, detail)
    queue = queue_at_capacity(detail, t.flags)
    rules = alert_rules(view.slos, queue_at_capacity=queue, name=name)
    hpa = autoscaler(options.dns_name, min_replicas=plan.replicas, max_replicas=plan.max_replicas, queue_target=queue)
    text = kubernetes_with(
        flags, options, provenance, replicas=plan.replicas, extra=[hpa, prometheus_rule(rules, name=name)]
    )
    return plan, text


def tokens_per_request(detail: Any) -> float | None:
    """Output tokens a successful request brought in the winner's measurement (the store's load summary)."""
    summary = getattr(detail, "load_summary", None) or {}
    done, tokens = summary.get("requests_succeeded"), summary.get("completion_tokens")
    if isinstance(done, int) and done > 0 and isinstance(tokens, int) and tokens > 0:
        return tokens / done
    return None


def queue_at_capacity(detail: Any, flags: dict[str, Any]) -> float:
    """The most requests the winner kept waiting at its measured capacity (the store's server metrics), at least 1 so
    a winner that held no queue does not page on one waiting request; else a full batch of max_num_seqs, the queue a
    server past its batch builds first."""
    metrics = getattr(detail, "server_metrics", None) or {}
    waiting = metrics.get("waiting_max")
    if isinstance(waiting, int | float):
        return max(float(waiting), 1.0)
    seqs = flags.get("max_num_seqs")
    return float(seqs) if isinstance(seqs, int | float) else 256.0
