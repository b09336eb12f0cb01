"""What an export needs from a study: the model vLLM should load, the image, the secrets' names, the provenance."""

from __future__ import annotations

from typing import Any

from tuner import __version__
from tuner.errors import ConfigError
from tuner.export import DEFAULT_IMAGE, DeployOptions, Provenance
from tuner.report.views import StudyView, TrialView

__all__ = ["deploy_options", "provenance"]


def deploy_options(
    view: StudyView,
    *,
    model: str | None = None,
    image: str | None = None,
    port: int = 8000,
    name: str = "vllm",
    secret_env: tuple[str, ...] | None = None,
) -> DeployOptions:
    """Explicit choices win; else what the study and its job file recorded."""
    a = view.attrs
    model_name = model or _hub_model(a)
    if not model_name:
        raise ConfigError("the study records no model: give --model NAME")
    return DeployOptions(
        model=model_name,
        image=image or _image(a),
        port=port,
        name=name,
        secret_env=secret_env if secret_env is not None else _secret_names(a),
    )


def provenance(view: StudyView, t: TrialView) -> Provenance:
    a = view.attrs
    return Provenance(
        study=view.name,
        trial=t.number,
        baseline=t.baseline,
        image=_opt(a.get("image")),
        gpu=_opt(a.get("gpu")),
        model=_opt(a.get("model")),
        launcher=_opt(a.get("launcher")),
        workload_hash=_opt(a.get("workload_hash")),
        output_tok_s=t.throughput,
        latency_p95_s=t.latency_p95_s,
        ttft_p95_s=t.ttft_p95_s,
        e2e_p95_s=t.e2e_p95_s,
        success_rate=t.success_rate,
        slos=tuple(view.slos),
        tuner_version=__version__,
    )


def _hub_model(attrs: dict[str, Any]) -> str:
    """The name vLLM should load: the job's `model_id` for its launcher, else a built-in profile's Hugging Face id,
    else the model name or path as the study recorded it."""
    from tuner.catalog import BUILTIN_MODELS

    target = _job_target(attrs)
    for section in (str(attrs.get("launcher") or ""), "docker", "process"):
        model_id = (target.get(section) or {}).get("model_id") if isinstance(target.get(section), dict) else None
        if isinstance(model_id, str) and model_id:
            return model_id
    name = str(attrs.get("model") or "")
    profile = BUILTIN_MODELS.get(name.strip().lower())
    return profile.name if profile is not None else name


def _job_target(attrs: dict[str, Any]) -> dict[str, Any]:
    job = attrs.get("job")
    target = job.get("target") if isinstance(job, dict) else None
    return target if isinstance(target, dict) else {}


def _image(attrs: dict[str, Any]) -> str:
    """The image measured (docker launcher), else the job's vLLM image (pinned by the job file), else the default."""
    docker = _job_target(attrs).get("docker")
    job_image = docker.get("image") if isinstance(docker, dict) else None
    return str(attrs.get("image") or job_image or DEFAULT_IMAGE)


def _secret_names(attrs: dict[str, Any]) -> tuple[str, ...]:
    """HF_TOKEN, plus every variable the job passed through to its server (names only: values never stored)."""
    target = _job_target(attrs)
    names = ["HF_TOKEN"]
    for section in ("docker", "process"):
        env = (target.get(section) or {}).get("env") if isinstance(target.get(section), dict) else None
        names += [str(n) for n in env or [] if isinstance(n, str)]
    return tuple(dict.fromkeys(names))


def _opt(v: Any) -> str | None:
    return str(v) if v is not None else None
