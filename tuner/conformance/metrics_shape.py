"""`/metrics` reduced to its shape: each `vllm:` family's type, label names, the values of its enumerating labels
(`finished_reason`, `reason`, `source`, ...) and a histogram's bucket bounds. Sample values are left out."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Labels whose values name the server, not the metric's meaning.
_INSTANCE_LABELS = frozenset({"model_name", "engine"})


def metrics_shape(text: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue  # the process's and the HTTP framework's own series (python_gc_*, http_*) are not vLLM's
        labels: set[str] = set()
        values: dict[str, set[str]] = {}
        bounds: list[str] = []
        for sample in family.samples:
            for name, value in sample.labels.items():
                if name == "le":
                    if value not in bounds:
                        bounds.append(value)
                    continue
                labels.add(name)
                values.setdefault(name, set()).add(value)
        entry: dict[str, Any] = {"type": family.type, "labels": sorted(labels)}
        if not family.name.endswith("_info"):  # an info family's label values are the configuration itself
            enumerated = {k: sorted(v) for k, v in sorted(values.items()) if k not in _INSTANCE_LABELS}
            if enumerated:
                entry["label_values"] = enumerated
        if bounds:
            entry["buckets"] = bounds
        out[family.name] = entry
    return dict(sorted(out.items()))
