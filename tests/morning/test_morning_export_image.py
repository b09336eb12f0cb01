"""The exported image follows the vLLM version the trial measured, unless the job pinned one (then a note says so
when they differ); a study from before versions were recorded keeps the image it recorded."""

from __future__ import annotations

from typing import Any

import optuna

from tuner.export import DEFAULT_IMAGE, render
from tuner.flags import VllmFlags
from tuner.report.deployment import deploy_options, export_image, provenance
from tuner.report.views import StudyView, trial_view


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
