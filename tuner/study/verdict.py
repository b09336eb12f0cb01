"""A trial's verdict in Optuna's terms: the two values, the constraints, and the record the readers read.

Directions: maximize output tok/s (the cost objective: million output tokens per dollar at the job's load,
`tuner.cost`), minimize the job's primary latency P95 (seconds). SLOs are constraints named
"slo:<slo>" (<= 0 met); a failure is the worst values with a positive "startup" constraint, graded by how far from
starting the flags were, so every sampler steers away from the region (see the package's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tuner.box import box_figures
from tuner.catalog.gpus import GpuProfile
from tuner.catalog.models import ModelProfile
from tuner.cost import CostFigures, JobLoad, cost_figures, scored_tok_s, tokens_per_request
from tuner.flags import resolve
from tuner.load.results import LoadResult
from tuner.record import MEASURED, RECORD_VERSION, TrialRecord
from tuner.scoring import LoadSummary, Slo, closest, objective_latency, study_figures
from tuner.study.trial import TrialResult

__all__ = ["DIRECTIONS", "STARTUP_CONSTRAINT", "Scorer"]

DIRECTIONS: list[Literal["maximize", "minimize"]] = ["maximize", "minimize"]
STARTUP_CONSTRAINT = "startup"

# How far from starting a refusal is, as the "startup" constraint (> 0: infeasible). Above any SLO violation a
# measured trial usually has, so the sampler ranks "ran but slow" above "did not run"; graded within a reason.
_STARTUP_VIOLATION = {
    "invalid_flags": 13.0,
    "insufficient_free_memory": 12.0,
    "no_kv_memory": 12.0,
    "cuda_oom": 11.0,
    "shape_does_not_fit": 13.0,  # more GPUs than the box has (target.gpus): never launched
    "kv_cache_too_small": 10.0,  # + the missing fraction of max_model_len
    "crashed_under_load": 10.5,
    "start_timeout": 10.0,
    "unknown": 10.0,
}

Values = tuple[float, float]


@dataclass(frozen=True)
class Scorer:
    """Scores a trial's result against the job's SLOs and primary latency; `worst_latency` is the request timeout."""

    slos: list[Slo]
    latency_metric: str
    worst_latency: float
    gpu: GpuProfile
    model: ModelProfile
    box_gpus: int = 1
    gpu_hour_usd: float | None = None
    # The cost objective's load (None: another objective): each trial is scored by what serving it costs.
    cost_load: JobLoad | None = None

    def scored_summary(self, result: TrialResult) -> tuple[LoadSummary | None, list[float] | None]:
        """The summary the trial is scored on, and (for a capacity search that met no SLOs) its step's violations."""
        m = result.measurement
        if m is None:
            return None, None
        if m.result is not None:
            return m.result.summary, None
        if m.steps:
            # No rate met the SLOs: score the step that came closest, so the sampler sees how far off it was.
            step = m.steps[closest([s.violations for s in m.steps])]
            return step.summary, list(step.violations) or None
        return None, None

    def values_and_constraints(self, result: TrialResult) -> tuple[Values, dict[str, float]]:
        zero_slos = {f"slo:{s}": 0.0 for s in self.slos}
        worst = (0.0, self.worst_latency)
        if result.outcome == MEASURED:
            summary, violations = self.scored_summary(result)
            if summary is not None:
                latency = objective_latency(summary, self.latency_metric, self.worst_latency)
                if violations is not None and len(violations) == len(self.slos):
                    slo_c = {f"slo:{s}": float(v) for s, v in zip(self.slos, violations, strict=True)}
                else:
                    slo_c = {f"slo:{s}": float(s.violation(summary)) for s in self.slos}
                return (self._first_value(result, summary), latency), {STARTUP_CONSTRAINT: 0.0, **slo_c}
            # A load phase that produced nothing: as bad as a crash, and counted as one.
            return worst, {STARTUP_CONSTRAINT: _STARTUP_VIOLATION["unknown"], **zero_slos}
        return worst, {STARTUP_CONSTRAINT: self._startup_violation(result), **zero_slos}

    def _first_value(self, result: TrialResult, summary: LoadSummary) -> float:
        """The box's output tok/s; for the cost objective, million output tokens per dollar (0: no capacity)."""
        if self.cost_load is None:
            return replica_tok_s(result, summary) * _replicas(result)
        cost = self.cost(result)
        return cost.value if cost is not None else 0.0

    def cost(self, result: TrialResult) -> CostFigures | None:
        """What serving the job's load with replicas of this shape costs; None for another objective, or a replica
        that met the SLOs at no rate."""
        m = result.measurement
        if self.cost_load is None or m is None or m.result is None or not m.rate:
            return None
        summary = m.result.summary
        return cost_figures(
            m.rate,
            tokens_per_request(summary),
            world_size=result.flags.world_size,
            load=self.cost_load,
            in_flight=float(summary.concurrency),
            gpu_hour_usd=self.gpu_hour_usd,
        )

    def _startup_violation(self, result: TrialResult) -> float:
        severity = _STARTUP_VIOLATION.get(result.reason or "unknown", 10.0)
        if result.reason == "kv_cache_too_small":
            need = resolve(result.flags, self.gpu, self.model).max_model_len
            have = (result.prediction.estimated_max_model_len if result.prediction else None) or 0
            if result.facts and result.facts.get("kv_tokens"):
                have = int(result.facts["kv_tokens"])
            severity += max(0.0, min(1.0, (need - have) / need)) if need else 1.0
        return severity

    def record(self, result: TrialResult, constraints: dict[str, float], known: TrialRecord) -> TrialRecord:
        """The trial's record: `known` (flags, notes, prediction, written before the launch) and the verdict."""
        summary, _ = self.scored_summary(result)
        m = result.measurement
        loaded = m.result if m is not None else None
        facts = result.facts or {}
        verdict: dict[str, Any] = {
            "record_version": RECORD_VERSION,
            "outcome": result.outcome,
            "reason": result.reason,
            "message": result.message[:500] if result.message else None,
            "diagnosis": (loaded.diagnosis if loaded is not None else None) or None,
            "kv_tokens": int(facts["kv_tokens"]) if facts.get("kv_tokens") else None,
            "vllm_version": str(facts["vllm_version"]) if facts.get("vllm_version") else None,
            "devices": [str(d) for d in facts["devices"]] if facts.get("devices") else [],
            "feasible": all(v <= 0 for v in constraints.values()),
            "server_seconds": round(result.server_seconds, 3),
            "constraints": list(constraints.values()),
            "constraint_names": list(constraints),
            "attempts": result.attempts,
            "latency_metric": self.latency_metric,
        }
        if m is not None and m.contention is not None:
            verdict["contention"] = m.contention.model_dump(mode="json")
        if result.outcome == MEASURED and summary is not None:
            verdict.update(_figures(summary, self))
            verdict["request_rate"] = m.rate if m is not None else None
            verdict["slo_stop"] = loaded.slo_stop if loaded is not None else None
            if loaded is not None:
                verdict.update(_reuse_figures(loaded))
            verdict.update(self._box(result, summary, verdict["request_rate"]))
        return known.model_copy(update=verdict)

    def _box(self, result: TrialResult, summary: LoadSummary, rate: float | None) -> dict[str, Any]:
        cost = self.cost(result)
        if self.cost_load is not None and cost is None:
            return {}  # no rate met the SLOs: no box the load could be served by
        box = box_figures(
            # a cost trial's replica at its capacity rate, a request's tokens counted whole (`tuner.cost`)
            cost.box_tok_s / cost.replicas if cost is not None else replica_tok_s(result, summary),
            rate,
            n_replicas=cost.replicas if cost is not None else _replicas(result),
            # The cost objective's box is the one the job's load needs, not `target.gpus` (a node's bound on a shape).
            box_gpus=cost.gpus if cost is not None else self.box_gpus,
            gpu_hour_usd=self.gpu_hour_usd,
        )
        return _cost_record(cost) | {
            "replicas": box.replicas,
            "box_gpus": box.gpus,
            "box_output_tok_s": box.output_tok_s,
            "box_request_rate": box.request_rate,
            "tok_s_per_gpu": box.tok_s_per_gpu,
            "usd_per_m_tokens": box.usd_per_m_tokens,
            "gpu_hours_per_m_requests": box.gpu_hours_per_m_requests,
        }


def replica_tok_s(result: TrialResult, summary: LoadSummary) -> float:
    """One replica's output tok/s as the trial is scored (`tuner.cost.scored_tok_s`): a capacity search's rate
    counts only where it met the SLOs (its scored step); a fixed load's figure is its run's."""
    m = result.measurement
    met = m is not None and bool(m.steps) and m.result is not None
    return scored_tok_s(summary, m.rate if met and m is not None else None)


def _cost_record(cost: CostFigures | None) -> dict[str, Any]:
    if cost is None:
        return {}
    return {
        "cost_load_rate": cost.load_rate,
        "cost_gpu_hours_per_m_tokens": cost.gpu_hours_per_m_tokens,
        "cost_usd_per_hour": cost.usd_per_hour,
        "cost_usd_per_m_tokens": cost.usd_per_m_tokens,
    }


def _replicas(result: TrialResult) -> int:
    return result.measurement.replicas if result.measurement is not None else 1


def _reuse_figures(loaded: LoadResult) -> dict[str, Any]:
    """What a workload that reuses prompts shows: TTFT of first turns against later ones, the prefix-cache hit rate."""
    turns, server = loaded.turns, loaded.server
    return {
        "ttft_p95_first_turn_s": turns.ttft_p95_first_s if turns is not None else None,
        "ttft_p95_later_turns_s": turns.ttft_p95_later_s if turns is not None else None,
        "prefix_cache_hit_rate": server.prefix_cache_hit_rate if server is not None else None,
    }


def _figures(summary: LoadSummary, scorer: Scorer) -> dict[str, Any]:
    # The figures the job's SLOs and objective name (a `ttft_p90` SLO's TTFT P90), beside the registry's: the
    # figure a verdict was made on is in the record, its tables and its CSV.
    names = [*(s.metric for s in scorer.slos), scorer.latency_metric]
    latencies = {f.name: f.of(summary) for f in study_figures(names)}
    return {
        "output_tok_s": float(summary.output_throughput),
        "success_rate": float(summary.success_rate),
        "latencies": {name: value for name, value in latencies.items() if value is not None},
        "goodput": float(summary.goodput),
        "good_share": float(summary.good_share),
    }
