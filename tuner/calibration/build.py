"""From measured loads to a profile file: a probe's load points or a study's trials, the fit, the record."""

from __future__ import annotations

import datetime as dt
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

from tuner.calibration.fit import FitResult, LoadPoint, Measured, Prediction, fit_coefficients, fit_loads
from tuner.calibration.replay import EngineShape, engine_shape
from tuner.calibration.trials import StoredTrial, StudyTrials
from tuner.step_profile import FitPoint, FittedFrom, StepProfile

__all__ = ["engine_shape", "fit_profile", "fit_study"]

# A study's trials mostly keep the engine busy, where a request's latency shows only in which step it joins: the
# fit first counts each wait as latency (fit_loads' smooth rounds) to find it, then settles on exact replays.
SMOOTH_ROUNDS = 20


def fit_profile(
    shape: EngineShape,
    measured: Sequence[tuple[LoadPoint, Measured]],
    *,
    served_model: str,
    vllm_version: str | None,
    source: Literal["probe", "study", "synthetic"],
    url: str | None = None,
    study: str | None = None,
) -> StepProfile:
    """A probe's load points, all on one server."""
    fit, rounds = fit_coefficients(shape, list(measured))
    points = [
        FitPoint(
            concurrency=p.concurrency,
            input_len=p.input_len,
            output_len=p.output_len,
            requests=p.requests,
            **_figures(m, pred),
        )
        for (p, m), pred in zip(measured, fit.predictions, strict=True)
    ]
    fitted = _fitted_from(fit, rounds, points, source=source, url=url, study=study)
    return _profile(shape, fit, fitted, served_model=served_model, vllm_version=vllm_version)


def fit_study(trials: StudyTrials, on_round: Callable[[int, float], None] | None = None) -> StepProfile:
    """A study's trials, each on its own server. The profile's server fields are its first trial's (the
    baseline, vLLM's defaults, when the study measured it); each point keeps its trial's flags."""
    trials.require()
    loads = [(t.shape, t.load, t.measured) for t in trials.used]
    fit, rounds = fit_loads(loads, smooth_rounds=SMOOTH_ROUNDS, on_round=on_round)
    points = [_trial_point(t, pred) for t, pred in zip(trials.used, fit.predictions, strict=True)]
    fitted = _fitted_from(fit, rounds, points, source="study", url=None, study=trials.study)
    versions = Counter(t.vllm_version for t in trials.used if t.vllm_version)
    version = versions.most_common(1)[0][0] if versions else None
    return _profile(trials.used[0].shape, fit, fitted, served_model=trials.model, vllm_version=version)


def _trial_point(t: StoredTrial, pred: Prediction) -> FitPoint:
    shown = [r for r in t.load.requests if not r.warmup]
    return FitPoint(
        concurrency=t.load.concurrency,
        input_len=statistics.fmean(r.prompt_len for r in shown),
        output_len=statistics.fmean(r.output_len for r in shown),
        requests=len(shown),
        flags={k: v for k, v in t.flags.items() if isinstance(v, int | float | str | bool)},
        trial=t.number,
        **_figures(t.measured, pred),
    )


def _figures(m: Measured, pred: Prediction) -> dict[str, float]:
    return {
        "measured_output_tok_s": m.output_tok_s,
        "measured_ttft_mean_s": m.ttft_mean_s,
        "measured_tpot_mean_s": m.tpot_mean_s,
        "predicted_output_tok_s": pred.output_tok_s,
        "predicted_ttft_mean_s": pred.ttft_mean_s,
        "predicted_tpot_mean_s": pred.tpot_mean_s,
    }


def _fitted_from(
    fit: FitResult,
    rounds: int,
    points: list[FitPoint],
    *,
    source: Literal["probe", "study", "synthetic"],
    url: str | None,
    study: str | None,
) -> FittedFrom:
    return FittedFrom(
        source=source,
        url=url,
        study=study,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        points=points,
        relative_rms_error=fit.relative_rms_error,
        iterations=rounds,
    )


def _profile(
    shape: EngineShape, fit: FitResult, fitted: FittedFrom, *, served_model: str, vllm_version: str | None
) -> StepProfile:
    f = shape.flags
    return StepProfile(
        device=shape.device.key,
        device_name=shape.device.device_name,
        model=served_model,
        vllm_version=vllm_version,
        block_size=f.block_size,
        max_num_seqs=f.max_num_seqs,
        max_num_batched_tokens=f.max_num_batched_tokens,
        num_gpu_blocks=shape.plan.num_gpu_blocks,
        coefficients=fit.coefficients,
        fitted_from=fitted,
    )
