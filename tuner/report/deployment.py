"""What an export needs from a study: the model vLLM should load, the image, the secrets' names, the provenance."""

from __future__ import annotations

from typing import Any

from tuner import __version__
from tuner.errors import ConfigError
from tuner.export import DEFAULT_IMAGE, DeployOptions, Provenance
from tuner.launch.docker import DEFAULT_IMAGE as LAUNCHER_IMAGE
from tuner.launch.docker import image_for
from tuner.record import StoredLauncherOptions
from tuner.report.uncertainty import trial_intervals
from tuner.report.views import StudyView, TrialView

__all__ = ["IMAGE_REPOSITORY", "ROCM_REPOSITORY", "cost_note", "deploy_options", "export_image", "provenance"]

IMAGE_REPOSITORY = "vllm/vllm-openai"
ROCM_REPOSITORY = "vllm/vllm-openai-rocm"


def deploy_options(
    view: StudyView,
    trial: TrialView | None = None,
    *,
    model: str | None = None,
    image: str | None = None,
    port: int = 8000,
    name: str = "vllm",
    secret_env: tuple[str, ...] | None = None,
) -> DeployOptions:
    """Explicit choices win; else what the study and its job file recorded."""
    model_name = model or _hub_model(view)
    if not model_name:
        raise ConfigError("the study records no model: give --model NAME")
    return DeployOptions(
        model=model_name,
        served_model_name=_served_model_name(view),
        image=image or export_image(view, trial)[0],
        port=port,
        name=name,
        secret_env=secret_env if secret_env is not None else _secret_names(view),
        gpu_vendor=_vendor(view),
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
        # A cost study's first value is tokens per $, not tok/s: the replica's measured figure, its cost a note.
        output_tok_s=t.output_tok_s if t.costed else t.throughput,
        objective_latency_s=t.objective_latency_s,
        latency_metric=view.latency_metric,
        latencies=dict(t.latencies),
        shown_figures=tuple(view.headline_figures),
        success_rate=t.success_rate,
        slos=tuple(view.slos),
        tuner_version=__version__,
        vllm_version=t.vllm_version,
        notes=tuple(note for note in (export_image(view, t)[1], cost_note(t)) if note),
        **_intervals(view, t),
    )


def cost_note(t: TrialView) -> str | None:
    """What a cost study chose this trial for: the deployment the job's load needs and what it costs."""
    if not t.costed or t.replicas is None or t.box_gpus is None:
        return None
    each = t.box_gpus // max(1, t.replicas)
    price = f", ${t.cost_usd_per_hour:,.2f} an hour" if t.cost_usd_per_hour is not None else ""
    per_m = t.cost_text + (" per million output tokens" if t.cost_usd_per_m_tokens is not None else " per M tokens")
    return (
        f"cost objective: {t.replicas} replica{'s' if t.replicas != 1 else ''} x {each} GPU{'s' if each != 1 else ''} "
        f"for the job's {t.cost_load_rate or 0:.2f} req/s{price}, {per_m}; output tok/s above is one replica's "
        "at its capacity within the SLOs"
    )


def _intervals(view: StudyView, t: TrialView) -> dict[str, Any]:
    """The provenance's intervals: the flag set's over its starts where it was started more than once (the figure
    shown is then that pooled figure's interval), else its run's own."""
    cis = trial_intervals(view, t.number)
    over = {ci.name: ci.starts for ci in cis if ci.starts is not None}
    if over:
        return {"intervals": {k: (i.value, i.low, i.high) for k, i in over.items()}, "starts": cis[0].n_starts}
    run = {ci.name: ci.run for ci in cis if ci.run is not None and ci.run.high > ci.run.low}
    return {"intervals": {k: (i.value, i.low, i.high) for k, i in run.items()}, "starts": 1}


def _launcher_options(view: StudyView) -> list[StoredLauncherOptions]:
    """The options sections that describe how the study's servers ran: its launcher's first."""
    target = view.job.target
    names = dict.fromkeys((view.record.launcher or "", "docker", "process"))
    return [options for name in names if (options := target.section(name)) is not None]


def _served_model_name(view: StudyView) -> str | None:
    """The name clients asked the study's servers for (`served_model_name`), so the export answers to it too."""
    options = _launcher_options(view)[:1]
    name = options[0].options.get("served_model_name") if options else None
    return str(name) if isinstance(name, str) and name else None


def _hub_model(view: StudyView) -> str:
    """The name vLLM should load: the job's `model_id` for its launcher, else a built-in profile's Hugging Face id,
    else the model name or path as the study recorded it."""
    from tuner.catalog import BUILTIN_MODELS

    for options in _launcher_options(view):
        if options.model_id:
            return options.model_id
    name = view.record.model or ""
    profile = BUILTIN_MODELS.get(name.strip().lower())
    return profile.name if profile is not None else name


def export_image(view: StudyView, t: TrialView | None) -> tuple[str, str | None]:
    """The image to deploy and, when it is not the vLLM the trial measured, a note that says so.

    The trial's own vLLM version decides (vLLM's image of that release: what was measured is what ships) unless the
    job pinned an image; a study written before versions were recorded keeps the image it recorded.
    """
    amd = _vendor(view) == "amd"
    stored = view.record.image or view.job.target.docker.image
    measured = t.vllm_version if t is not None else None
    pinned = view.record.image_pinned
    if measured and (pinned is False or not stored):
        repo = ROCM_REPOSITORY if amd else IMAGE_REPOSITORY
        return f"{repo}:v{measured}", None
    if amd and not pinned:
        # The CUDA image a job names by default (or none at all) is not what AMD GPUs run: the launcher's ROCm one.
        stored = image_for(str(stored or LAUNCHER_IMAGE), "amd")
    image = str(stored or DEFAULT_IMAGE)
    tag = image.rpartition(":")[2].removeprefix("v") if ":" in image.rpartition("/")[2] else None
    if measured and tag != measured:
        return image, f"image {image} was pinned by the job; the trial measured vLLM {measured}"
    return image, None


def _vendor(view: StudyView) -> str:
    profile = view.record.gpu_profile
    return str(profile.get("vendor") or "nvidia") if profile is not None else "nvidia"


def _secret_names(view: StudyView) -> tuple[str, ...]:
    """HF_TOKEN, plus every variable the job passed through to its server (names only: values never stored)."""
    target = view.job.target
    return tuple(dict.fromkeys(["HF_TOKEN", *target.docker.env, *target.process.env]))


def _opt(v: Any) -> str | None:
    return str(v) if v is not None else None
