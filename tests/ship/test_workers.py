"""`tuner export-workers`: one study tuned on many GPU nodes by an Indexed Job of workers."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import run_main

JOB: dict[str, Any] = {
    "study": {"name": "night qwen"},
    "target": {
        "launcher": "process",
        "model": "llama-3.1-8b",
        "gpu": "h100-80gb",
        "process": {"command": ["vllm", "serve", "{model}", "--port", "{port}"], "env": ["HF_TOKEN"]},
    },
    "space": {"max_num_seqs": {"low": 8, "high": 128}, "tensor_parallel_size": {"choices": [1, 2]}},
    "workload": {"input_len": 512, "output_len": 64},
    "arrival": {"concurrency": 8, "requests": 64},
}


# A stand-in pynvml: a box of $FAKE_NVML_GPUS L4s, for `gpu: auto` (tests/study/fake_nvml)
FAKE_NVML = Path(__file__).parent.parent / "study" / "fake_nvml" / "pynvml.py"


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def export_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Done]:
    """`tuner export-workers JOB ARGS` in this process (its real entry point, errors and exit code included), on a
    machine whose NVML sees `gpus` L4s: the stand-in pynvml stands for the real one while the test runs."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML)
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("COLUMNS", "200")

    def run(doc: dict[str, Any], *args: str, gpus: int = 4) -> Done:
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(doc))
        monkeypatch.setenv("FAKE_NVML_GPUS", str(gpus))
        code, out, err = run_main(["export-workers", str(job), *args], capsys, monkeypatch)
        return Done(code, out, err)

    return run


def test_the_manifest_names_the_study_the_secret_and_the_gpus_a_trial_needs(
    export_workers: Callable[..., Done],
) -> None:
    done = export_workers(JOB, "--nodes", "4", "--secret", "pg", "--secret-env", "HF_TOKEN")
    assert done.returncode == 0, done.stderr
    config_map, job = list(yaml.safe_load_all(done.stdout))
    assert config_map["kind"] == "ConfigMap" and yaml.safe_load(config_map["data"]["job.yaml"]) == JOB
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    pod = job["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["command"] == ["tuner", "tune", "/etc/tuner/job.yaml"]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": 2}  # the largest tensor_parallel_size of the space
    env = {e["name"]: e for e in worker["env"]}
    assert env["TUNER_STORAGE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "pg", "key": "url"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "pg", "key": "HF_TOKEN"}
    assert all("value" not in e for e in worker["env"])  # secrets by reference only
    assert job["metadata"]["labels"]["tuner/study"] == "night-qwen"  # a label value may hold no space
    assert pod["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"] == "tuner-night-qwen"
    spread = pod["topologySpreadConstraints"][0]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "DoNotSchedule"


def test_gpu_auto_is_left_to_the_nodes_when_the_writing_machine_has_no_gpu(export_workers: Callable[..., Done]) -> None:
    """The manifest is written on a laptop or a CI runner; `gpu: auto` is each node's to read when it runs."""
    doc = {**JOB, "target": {**JOB["target"], "gpu": "auto"}}
    done = export_workers(doc, "--nodes", "2", gpus=0)
    assert done.returncode == 0, done.stderr
    _, job = list(yaml.safe_load_all(done.stdout))
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 2}
    (note,) = done.stderr.splitlines()
    assert note.startswith("note: target.gpu auto is read on each node; this machine has no GPU")
    assert "--gpu-resource amd.com/gpu" in note
    # With a GPU here, the job resolves it as `tuner tune` would: no stand-in, no note.
    here = export_workers(doc, "--nodes", "2")
    assert here.returncode == 0 and "note:" not in here.stderr, here.stderr


def test_one_gpu_a_pod_when_the_space_does_not_parallelise(export_workers: Callable[..., Done]) -> None:
    doc = {**JOB, "space": {"max_num_seqs": {"low": 8, "high": 128}}}
    done = export_workers(doc)
    assert done.returncode == 0, done.stderr
    job = list(yaml.safe_load_all(done.stdout))[1]
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}


def limits(done: Done) -> Any:
    assert done.returncode == 0, done.stderr
    job = list(yaml.safe_load_all(done.stdout))[1]
    return job["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits")


@pytest.mark.parametrize(
    ("gpu", "args", "expected"),
    [
        ("mi300x", [], {"amd.com/gpu": 2}),  # the job's GPU names its vendor: AMD's device plugin
        ({"name": "mi325x", "memory_gib": 256, "vendor": "amd"}, [], {"amd.com/gpu": 2}),
        ("auto", [], {"nvidia.com/gpu": 2}),  # the job resolves auto to this machine's GPUs (4 fake L4s)
        ("auto", ["--gpu-resource", "amd.com/gpu"], {"amd.com/gpu": 2}),
        ("h100-80gb", ["--gpu-resource", "nvidia.com/mig-3g.40gb"], {"nvidia.com/mig-3g.40gb": 2}),
        ("cpu", [], None),  # vLLM's CPU build asks for no GPU
    ],
)
def test_the_pods_gpu_resource_follows_the_gpu_vendor(
    export_workers: Callable[..., Done], gpu: str | dict[str, Any], args: list[str], expected: dict[str, int] | None
) -> None:
    assert limits(export_workers({**JOB, "target": {**JOB["target"], "gpu": gpu}}, *args)) == expected


@pytest.mark.parametrize(
    ("change", "args", "said"),
    [
        ({"target": {**JOB["target"], "launcher": "docker"}}, [], "target.launcher: 'docker'; the cluster's workers"),
        ({}, ["--nodes", "0"], "--nodes 0: give 1 or more"),
        ({}, ["--gpu-resource", "gpu"], "--gpu-resource 'gpu': give an extended resource name such as amd.com/gpu"),
    ],
)
def test_mistakes_are_one_line(
    export_workers: Callable[..., Done], change: dict[str, Any], args: list[str], said: str
) -> None:
    done = export_workers({**JOB, **change}, *args)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
