"""A demo study written with Optuna's public API and the project's store, exactly as the contract describes a
tuner-run study (tuner/study.py's shapes: failed starts are COMPLETE with the worst values and a positive "startup"
constraint, SLOs are named constraints "slo:<slo>"): every measured value derives from per-request records through
tuner.scoring, so re-scoring can be checked by hand against the same records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState

from tuner.load.results import RequestRecord
from tuner.scoring import LoadSummary, figures, parse_slo, summarize
from tuner.store import open_store


@dataclass(frozen=True)
class Run:
    """One `tuner` invocation: exit code, stdout, stderr."""

    code: int
    out: str
    err: str


RunCli = Callable[..., Run]

STUDY = "demo"
SLOS = ["e2e_p95<=5s", "success_rate>=0.99"]
DURATION_S = 10.0
N_REQUESTS = 20
WORST_LATENCY_S = 60.0  # the job's request timeout: a failed start's latency value
DISTRIBUTIONS = {
    "max_num_seqs": IntDistribution(8, 1024, log=True),
    "max_model_len": IntDistribution(2048, 32768),
    "gpu_memory_utilization": FloatDistribution(0.80, 0.98),
    "max_num_batched_tokens": IntDistribution(512, 16384, log=True),
}


@dataclass(frozen=True)
class Spec:
    """One demo trial: measured ones by their output tok/s, e2e P95 and count of failed requests."""

    number: int
    flags: dict[str, Any]
    outcome: str = "measured"
    throughput: float = 0.0
    e2e_p95: float = 0.0
    failed: int = 0
    reason: str | None = None
    baseline: bool = False
    state: TrialState = TrialState.COMPLETE
    server_seconds: float = 120.0


def _flags(seqs: int, length: int, util: float, batched: int) -> dict[str, Any]:
    return {
        "max_num_seqs": seqs,
        "max_model_len": length,
        "gpu_memory_utilization": util,
        "max_num_batched_tokens": batched,
    }


SPECS = [
    Spec(0, _flags(1024, 32768, 0.90, 8192), throughput=2000.0, e2e_p95=4.0, baseline=True),
    Spec(1, _flags(128, 8192, 0.92, 4096), throughput=3000.0, e2e_p95=4.5),
    Spec(2, _flags(512, 8192, 0.95, 8192), throughput=3500.0, e2e_p95=6.0),
    Spec(3, _flags(64, 32768, 0.80, 2048), outcome="launch_failed", reason="kv_cache_too_small"),
    Spec(4, _flags(64, 8192, 0.92, 2048), throughput=2800.0, e2e_p95=2.5),
    Spec(
        5,
        _flags(256, 32768, 0.81, 16384),
        outcome="skipped_infeasible",
        reason="no_kv_memory",
        server_seconds=0.0,
    ),
    Spec(6, _flags(192, 8192, 0.93, 4096), throughput=3200.0, e2e_p95=3.5),
    Spec(7, _flags(32, 4096, 0.90, 1024), throughput=2000.0, e2e_p95=1.8),
    Spec(
        8,
        _flags(384, 16384, 0.98, 8192),
        outcome="crashed",
        reason="crashed_under_load",
        server_seconds=60.0,
    ),
    Spec(9, _flags(256, 8192, 0.94, 8192), throughput=3400.0, e2e_p95=4.8),
    Spec(10, _flags(448, 8192, 0.96, 8192), throughput=3600.0, e2e_p95=3.0, failed=2),
    Spec(11, _flags(96, 8192, 0.91, 4096), outcome="running", state=TrialState.RUNNING),
    # Ctrl-C: the one outcome the study leaves FAIL (it says nothing about the flags)
    Spec(
        12,
        _flags(160, 8192, 0.93, 4096),
        outcome="interrupted",
        reason="interrupted",
        state=TrialState.FAIL,
        server_seconds=30.0,
    ),
]


def records_for(spec: Spec) -> list[RequestRecord]:
    """N requests over DURATION_S: 18 at half the P95 and 2 at it, so P95 (linear interpolation) is exactly it;
    every successful request brings the same tokens, so output tok/s is exactly the spec's."""
    ok = N_REQUESTS - spec.failed
    tokens = round(spec.throughput * DURATION_S / ok)
    out = []
    for i in range(N_REQUESTS):
        e2e = spec.e2e_p95 if i >= N_REQUESTS - 2 else spec.e2e_p95 / 2
        failed = i < spec.failed
        out.append(
            RequestRecord(
                index=i,
                start_s=i * (DURATION_S - spec.e2e_p95) / N_REQUESTS,
                ttft_s=None if failed else e2e / 10,
                itl_s=[] if failed else [e2e * 0.9 / max(tokens - 1, 1)] * 3,
                e2e_s=e2e,
                prompt_tokens=256,
                completion_tokens=0 if failed else tokens,
                ok=not failed,
                error_class="http_5xx" if failed else None,
                error_message="HTTP 503: engine overloaded" if failed else None,
            )
        )
    return out


def build_demo_study(path: Path | str) -> str:
    """Write the demo study into a SQLite file (a path) or a database (a URL); returns its URL."""
    url = path if isinstance(path, str) else f"sqlite:///{path}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    slos = [parse_slo(s) for s in SLOS]
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name=STUDY, storage=storage, directions=["maximize", "minimize"])
    attrs: dict[str, Any] = {
        "tuner_version": "0.1.0",
        "gpu": "h100-80gb",
        "model": "llama-3.1-8b",
        "launcher": "emulator",
        "image": None,
        "workload_hash": "wl-5e1f00d",
        "slos": SLOS,
        "objective": "throughput",
        "n_trials": 16,
        "job": {
            "study": {"name": STUDY},
            "target": {"launcher": "emulator", "docker": {"env": ["HF_TOKEN", "VLLM_API_KEY"]}},
            "slos": SLOS,
            "request_timeout": WORST_LATENCY_S,
        },
    }
    for k, v in attrs.items():
        study.set_user_attr(k, v)
    store = open_store(url)
    try:
        for spec in SPECS:
            summary: LoadSummary | None = None
            ua: dict[str, Any] = {
                "flags": spec.flags,
                "baseline": spec.baseline,
                "outcome": spec.outcome if spec.state != TrialState.RUNNING else None,
                "reason": spec.reason,
                "server_seconds": spec.server_seconds,
                "kv_tokens": None,
                "predicted_kv_tokens": 480_000,
                "diagnosis": None,
                "feasible": False,
            }
            kwargs: dict[str, Any] = {}
            names = ["startup", *(f"slo:{x}" for x in SLOS)]
            if spec.state == TrialState.COMPLETE and spec.outcome != "measured":
                startup = {"kv_cache_too_small": 1.4, "no_kv_memory": 2.0, "crashed_under_load": 1.0}[spec.reason or ""]
                constraints = [startup, 0.0, 0.0]
                ua |= {"constraints": constraints, "constraint_names": names, "latency_metric": "e2e_p95"}
                kwargs = {"values": [0.0, WORST_LATENCY_S], "constraints": dict(zip(names, constraints, strict=True))}
            if spec.outcome == "measured":
                records = records_for(spec)
                summary = summarize(records, duration_s=DURATION_S, slos=slos)
                constraints = [0.0, *(s.violation(summary) for s in slos)]
                ua |= {
                    "output_tok_s": summary.output_throughput,
                    "request_rate": summary.request_throughput,
                    "success_rate": summary.success_rate,
                    **{f.attr: f.of(summary) for f in figures()},  # as the study writes them
                    "goodput": summary.goodput,
                    "good_share": summary.good_share,
                    "kv_tokens": 473_216,
                    "diagnosis": "bottleneck: KV cache (preemptions 12)" if spec.number == 2 else "bottleneck: decode",
                    "feasible": all(c <= 0 for c in constraints),
                    "constraints": constraints,
                    "constraint_names": names,
                    "latency_metric": "e2e_p95",
                }
                kwargs = {
                    "values": [summary.output_throughput, summary.e2e.p95],
                    "constraints": dict(zip(names, constraints, strict=True)),
                }
            ua = {k: v for k, v in ua.items() if v is not None or k in ("reason", "diagnosis")}
            study.add_trial(
                optuna.trial.create_trial(
                    state=spec.state, params=spec.flags, distributions=DISTRIBUTIONS, user_attrs=ua, **kwargs
                )
            )
            if spec.state == TrialState.RUNNING:
                continue
            store.save_trial(
                STUDY,
                spec.number,
                flags=spec.flags,
                baseline=spec.baseline,
                outcome=spec.outcome,
                reason=spec.reason,
                message="To serve at least one request with the model's max seq len (32768), ..."
                if spec.reason == "kv_cache_too_small"
                else None,
                prediction={"kv_tokens": 480_000, "max_concurrency": 14.6, "verdict": "starts"},
                startup_facts={"kv_tokens": 473_216, "weights_gib": 14.99} if spec.outcome == "measured" else None,
                load_summary=summary.model_dump() if summary is not None else None,
                server_metrics={"samples": 10, "kv_usage_max": 0.97, "preemptions": 12.0}
                if spec.outcome == "measured"
                else None,
                diagnosis=ua.get("diagnosis"),
                log_tail="INFO 12-02 03:00:00 [gpu_worker.py:241] Available KV cache memory: 57.1 GiB\n"
                "ERROR 12-02 03:00:01 [core.py:1] ValueError: To serve at least one request ..."
                if spec.outcome != "measured"
                else "INFO 12-02 03:00:00 [api_server.py:1] Application startup complete.",
                server_seconds=spec.server_seconds,
            )
            if spec.outcome == "measured":
                store.save_requests(STUDY, spec.number, records_for(spec))
    finally:
        store.close()
        storage.engine.dispose()
    return url
