"""The exported image follows the vLLM version the trial measured, unless the job pinned one (then a note says so
when they differ); a study from before versions were recorded keeps the image it recorded."""

from __future__ import annotations

from typing import Any

import optuna

from tuner.config import parse_job
from tuner.export import DEFAULT_IMAGE, render
from tuner.flags import VllmFlags
from tuner.launch import DockerLauncher
from tuner.launch.docker import ROCM_IMAGE
from tuner.report.deployment import deploy_options, export_image, provenance
from tuner.report.views import StudyView, trial_view
from tuner.study.storage import study_attrs
from tuner.vllm_pin import PINNED_VLLM


def _view(attrs: dict[str, Any], version: str | None) -> StudyView:
    record = {"outcome": "measured", "flags": {"max_num_seqs": 64}, "baseline": False}
    if version is not None:
        record["vllm_version"] = version
    frozen = optuna.trial.create_trial(values=[100.0, 1.0], user_attrs=record)
    base = {"model": "llama-3.1-8b", "gpu": "l4", "launcher": "docker", "slos": []}
    return StudyView("s", base | attrs, [trial_view(frozen)])


def test_an_unpinned_image_follows_the_measured_version() -> None:
    view = _view({"image": DEFAULT_IMAGE, "image_pinned": False}, "0.32.0")
    assert export_image(view, view.trials[0]) == ("vllm/vllm-openai:v0.32.0", None)
    options = deploy_options(view, view.trials[0])
    text = render("docker", VllmFlags(max_num_seqs=64), options, provenance(view, view.trials[0]))
    assert "vllm/vllm-openai:v0.32.0" in text
    assert "vLLM 0.32.0" in text  # the provenance names the version measured


def test_a_pinned_image_stays_and_a_different_version_is_stated() -> None:
    view = _view({"image": "vllm/vllm-openai:v0.30.1", "image_pinned": True}, "0.32.0")
    image, note = export_image(view, view.trials[0])
    assert image == "vllm/vllm-openai:v0.30.1"
    assert note == "image vllm/vllm-openai:v0.30.1 was pinned by the job; the trial measured vLLM 0.32.0"
    text = render("compose", VllmFlags(max_num_seqs=64), deploy_options(view, view.trials[0]),
                  provenance(view, view.trials[0]))  # fmt: skip
    assert "# note: image vllm/vllm-openai:v0.30.1 was pinned by the job; the trial measured vLLM 0.32.0" in text


def test_a_pinned_image_of_the_measured_version_needs_no_note() -> None:
    view = _view({"image": "vllm/vllm-openai:v0.32.0", "image_pinned": True}, "0.32.0")
    assert export_image(view, view.trials[0]) == ("vllm/vllm-openai:v0.32.0", None)


def test_amd_studies_follow_the_version_in_the_rocm_image() -> None:
    view = _view({"image_pinned": False, "launcher": "process", "gpu_profile": {"vendor": "amd"}}, "0.32.0")
    assert export_image(view, view.trials[0])[0] == "vllm/vllm-openai-rocm:v0.32.0"


def test_a_study_without_versions_keeps_its_recorded_image() -> None:
    view = _view({"image": "registry.local/vllm:custom"}, None)
    assert export_image(view, view.trials[0]) == ("registry.local/vllm:custom", None)


def test_the_export_answers_to_the_served_name_the_study_used() -> None:
    job = {"target": {"launcher": "process", "process": {"options": {"served_model_name": "tiny"}}}}
    view = _view({"launcher": "process", "job": job, "model": "/models/tiny"}, "0.32.0")
    options = deploy_options(view, view.trials[0])
    assert options.served_model_name == "tiny"
    assert "--served-model-name tiny" in render("vllm-args", VllmFlags(max_num_seqs=64), options)
    # A study whose servers answered to the model's own name exports none.
    assert deploy_options(_view({}, None)).served_model_name is None


def test_an_amd_study_exports_the_rocm_image_and_rocm_devices() -> None:
    amd = {"launcher": "docker", "image_pinned": False, "gpu_profile": {"vendor": "amd"}}
    # A study that recorded the CUDA default as its image and no vLLM version: AMD GPUs ran the pinned ROCm one.
    old = _view(amd | {"image": f"vllm/vllm-openai:v{PINNED_VLLM}"}, None)
    assert export_image(old, old.trials[0]) == (f"vllm/vllm-openai-rocm:v{PINNED_VLLM}", None)
    view = _view(amd, "0.32.0")
    options = deploy_options(view, view.trials[0])
    assert options.gpu_vendor == "amd" and options.image == "vllm/vllm-openai-rocm:v0.32.0"
    needles = {"docker": "--device /dev/kfd", "compose": "/dev/kfd:/dev/kfd", "kubernetes": "amd.com/gpu"}
    for fmt, needle in needles.items():
        text = render(fmt, VllmFlags(max_num_seqs=64), options)
        assert needle in text and "nvidia" not in text, fmt
    # A job's own image stays, on AMD as anywhere.
    pinned = _view(amd | {"image": "registry.local/rocm-vllm:1", "image_pinned": True}, None)
    assert export_image(pinned, pinned.trials[0])[0] == "registry.local/rocm-vllm:1"


def test_an_amd_docker_study_records_the_image_its_servers_ran() -> None:
    job = parse_job(
        {
            "study": {"name": "mi300x"},
            "target": {"launcher": "docker", "model": "llama-3.1-8b", "gpu": "mi300x"},
            "space": {"max_num_seqs": {"choices": [8, 16]}},
            "arrival": {"concurrency": 4, "requests": 8},
        }
    )
    assert study_attrs(job)["image"] == ROCM_IMAGE == f"vllm/vllm-openai-rocm:v{PINNED_VLLM}"
    assert DockerLauncher(model="m", vendor="amd", client=object()).image == ROCM_IMAGE
