"""The HorizontalPodAutoscaler: scale on the queue vLLM reports, between the plan's replica bounds."""

from __future__ import annotations

from typing import Any

__all__ = ["ADAPTER_RULE", "METRIC", "autoscaler"]

# The name the Prometheus adapter serves `vllm:num_requests_waiting` under: the custom metrics API takes no colon.
METRIC = "vllm_num_requests_waiting"

ADAPTER_RULE = (
    'prometheus-adapter rule: seriesQuery: vllm:num_requests_waiting{namespace!="",pod!=""}, '
    'name: {matches: "vllm:num_requests_waiting", as: "vllm_num_requests_waiting"}, '
    "metricsQuery: avg(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)"
)


def autoscaler(name: str, *, min_replicas: int, max_replicas: int, queue_target: float) -> dict[str, Any]:
    """autoscaling/v2 on the pods' average waiting requests; a new pod loads its weights for minutes, so scale-down
    waits ten minutes rather than dropping a replica a brief lull would want back."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "annotations": {"tuner/needs": ADAPTER_RULE}},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": METRIC},
                        "target": {"type": "AverageValue", "averageValue": f"{queue_target:g}"},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
        },
    }
