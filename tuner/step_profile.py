"""A device profile: the step-time coefficients fitted to one real server, and what they were fitted from.

The file is JSON, versioned (`profile_version`), and says where its figures came from (the server's URL or the
study, the vLLM version the server reported, the load points and how well the fit reproduces each), so a profile
read months later can be judged. `tuner emulate --profile FILE` and the twin (`target.profile` in a job) read it;
`tuner calibrate` writes it. It imports nothing of the emulator: the step-time model reads it, not the reverse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuner.errors import ConfigError

__all__ = ["PROFILE_VERSION", "FitPoint", "FittedFrom", "StepCoefficients", "StepProfile", "load_profile"]

PROFILE_VERSION: Literal[1] = 1


class StepCoefficients(BaseModel):
    """One engine step's duration, linear in what the step does (seconds):

        t = step_overhead_s + prefill_token_s x prefill tokens + decode_seq_s x decoding sequences
            + context_token_s x context tokens the step attends to (the KV cache it reads)

    and `request_latency_s`, outside the engine: from the client's send to the engine's queue (the API server's
    parsing, tokenising, the hand-over to the engine core, and the client's own turn-around). It delays a
    request's arrival, so it shows in TTFT and, in a closed loop, in every client's cycle; it occupies no step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    step_overhead_s: float = Field(ge=0, description="fixed cost of a step: scheduling, launch, sampler set-up")
    prefill_token_s: float = Field(ge=0, description="per prompt token computed in the step")
    decode_seq_s: float = Field(ge=0, description="per sequence decoding one token in the step")
    context_token_s: float = Field(ge=0, description="per cached token the step's attention reads")
    request_latency_s: float = Field(default=0.0, ge=0, description="per request, before the engine sees it")

    def as_vector(self) -> list[float]:
        return [
            self.step_overhead_s,
            self.prefill_token_s,
            self.decode_seq_s,
            self.context_token_s,
            self.request_latency_s,
        ]

    @classmethod
    def from_vector(cls, v: list[float]) -> StepCoefficients:
        return cls(
            step_overhead_s=v[0], prefill_token_s=v[1], decode_seq_s=v[2], context_token_s=v[3], request_latency_s=v[4]
        )


class FitPoint(BaseModel):
    """One load point the fit used: what was sent, what was measured, what the fitted model predicts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    concurrency: int | None = None  # a closed loop; None for a stored trial's own arrival
    input_len: float
    output_len: float
    requests: int
    flags: dict[str, int | float | str | bool] = Field(default_factory=dict)
    measured_output_tok_s: float
    measured_ttft_mean_s: float
    measured_tpot_mean_s: float
    predicted_output_tok_s: float = 0.0
    predicted_ttft_mean_s: float = 0.0
    predicted_tpot_mean_s: float = 0.0
    trial: int | None = None  # the stored trial's number, when fitted from a study


class FittedFrom(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: Literal["probe", "study", "synthetic"]
    url: str | None = None  # the probed server
    study: str | None = None  # the study's name (its storage URL is not kept: it may carry a password)
    created: str  # ISO 8601, UTC
    points: list[FitPoint]
    relative_rms_error: float  # over every (point, metric) row the fit weighed
    iterations: int = 1  # replays of the loads the fit took (each schedule re-simulated under a guess)


class StepProfile(BaseModel):
    """A device profile file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile_version: Literal[1] = PROFILE_VERSION
    device: str  # "cpu", or the GPU's catalog key
    device_name: str = ""
    model: str  # the served model the server ran (its name or path as given)
    vllm_version: str | None  # as the server reported it (/version); None if it did not say
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int | None = None  # the probed server's KV blocks (vllm:cache_config_info), when known
    coefficients: StepCoefficients
    fitted_from: FittedFrom

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")


def load_profile(path: str | Path) -> StepProfile:
    """Read a profile file; one ConfigError line naming the file and the problem when it is not one."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"profile {p}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"profile {p}: not UTF-8 text; a profile is the JSON `tuner calibrate` writes") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"profile {p}: not JSON ({e.msg} at line {e.lineno}); tuner calibrate writes one") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile {p}: not a profile (a JSON object from tuner calibrate)")
    version = data.get("profile_version")
    if version != PROFILE_VERSION:
        raise ConfigError(
            f"profile {p}: profile_version {version!r} is not one this tuner reads (allowed: {PROFILE_VERSION}); "
            "write it again with tuner calibrate"
        )
    try:
        return StepProfile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "profile"
        raise ConfigError(f"profile {p}: {where}: {err['msg']}") from None
