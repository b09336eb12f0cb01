"""From measured load points to a profile file: the engine shape of the probed server, the fit, the record."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Literal

from tuner.calibration.fit import EngineShape, LoadPoint, Measured, fit_coefficients
from tuner.calibration.profile import FitPoint, FittedFrom, StepProfile
from tuner.capacity import plan_startup
from tuner.catalog import GpuProfile, ModelProfile
from tuner.errors import ConfigError
from tuner.flags import VllmFlags, resolve

__all__ = ["engine_shape", "fit_profile"]


def engine_shape(
    model: ModelProfile, device: GpuProfile, flags: VllmFlags, num_gpu_blocks: int | None = None
) -> EngineShape:
    """The probed server as the engine imitates it: vLLM's defaults for the device, the flags it was started with,
    and its own KV block count when it told us (vllm:cache_config_info), else the start-up arithmetic's."""
    resolved = resolve(flags, device, model)
    plan = plan_startup(model, device, resolved)
    if num_gpu_blocks is None and not plan.ok:
        raise ConfigError(f"the server's KV blocks are unknown (no vllm:cache_config_info) and {plan.message}")
    if num_gpu_blocks is not None:
        plan = dataclasses.replace(
            plan, num_gpu_blocks=num_gpu_blocks, kv_tokens=num_gpu_blocks * resolved.block_size, reason=None
        )
    return EngineShape(model=model, device=device, flags=resolved, plan=plan)


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
    fit, rounds = fit_coefficients(shape, list(measured))
    points = [
        FitPoint(
            concurrency=p.concurrency,
            input_len=p.input_len,
            output_len=p.output_len,
            requests=p.requests,
            measured_output_tok_s=m.output_tok_s,
            measured_ttft_mean_s=m.ttft_mean_s,
            measured_tpot_mean_s=m.tpot_mean_s,
            predicted_output_tok_s=pred.output_tok_s,
            predicted_ttft_mean_s=pred.ttft_mean_s,
            predicted_tpot_mean_s=pred.tpot_mean_s,
        )
        for (p, m), pred in zip(measured, fit.predictions, strict=True)
    ]
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
        fitted_from=FittedFrom(
            source=source,
            url=url,
            study=study,
            created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            points=points,
            relative_rms_error=fit.relative_rms_error,
            iterations=rounds,
        ),
    )
