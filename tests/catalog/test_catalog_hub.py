"""Models by Hugging Face id: config and safetensors index from a local hub cache (tests/catalog/data/hub, laid out as
huggingface_hub lays it out), the hub offline; and a job file that names one passes `tuner tune --dry-run`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tuner.catalog import get_gpu, load_model
from tuner.errors import CatalogError
from tuner.feasibility import NO_PREDICTION, FeasibilityModel
from tuner.flags import VllmFlags

DATA = Path(__file__).parent / "data"
HUB = DATA / "hub"


@pytest.fixture
def hub_cache(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(HUB))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return HUB


def test_a_hub_id_reads_config_and_index_from_the_cache(hub_cache: Path) -> None:
    qwen = load_model("Qwen/Qwen3-8B")
    assert qwen.name == "Qwen/Qwen3-8B"  # what the launcher passes to vLLM as --model
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim, qwen.max_position_embeddings) == (36, 8, 128, 40960)
    assert qwen.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2
    # the index's metadata.total_size, not parameter arithmetic (which agrees here: bf16, no extra tensors)
    assert qwen.checkpoint_bytes == 16381470720 == qwen.weight_bytes
    assert qwen.num_params * 2 == 16381470720 - 2 * 36 * 128 * 2  # the arithmetic leaves out q_norm and k_norm


def test_a_model_missing_from_an_offline_cache_is_one_clear_line(hub_cache: Path) -> None:
    with pytest.raises(CatalogError, match=r"'Qwen/Qwen9-1B' is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        load_model("Qwen/Qwen9-1B")
    with pytest.raises(CatalogError, match=r"not a built-in profile .* not a Hugging Face id"):
        load_model("gpt-17")


def test_a_local_directory_still_works_and_prefers_its_index(tmp_path: Path) -> None:
    shutil.copy(DATA / "configs" / "Qwen--Qwen3-30B-A3B.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 61_064_245_248}}))
    moe = load_model(str(tmp_path))
    assert moe.name == str(tmp_path) and moe.weight_bytes == 61_064_245_248


def test_an_unknown_architecture_is_launched_to_measure_not_refused(tmp_path: Path) -> None:
    shutil.copy(DATA / "configs" / "Qwen--Qwen3-Next-80B-A3B-Thinking.json", tmp_path / "config.json")
    nxt = load_model(str(tmp_path))
    fm = FeasibilityModel(get_gpu("h200"), nxt)
    p = fm.predict(VllmFlags(max_model_len=8192, tensor_parallel_size=2))
    assert p.ok and not p.predicted
    assert p.describe().startswith(NO_PREDICTION)
    # vLLM's argument rules still apply: they do not depend on the architecture
    bad = fm.predict(VllmFlags(max_num_seqs=512, max_num_batched_tokens=256))
    assert not bad.ok and bad.reason == "invalid_flags"


def _job(tmp_path: Path, model: str, gpu: object) -> Path:
    job = {
        "study": {"name": "catalog-dry-run", "storage": f"sqlite:///{tmp_path / 'x.db'}"},
        "target": {"launcher": "docker", "model": model, "gpu": gpu},
        "space": {
            "max_num_seqs": {"low": 8, "high": 128, "log": True},
            "gpu_memory_utilization": {"low": 0.85, "high": 0.95, "step": 0.05},
            "max_model_len": 8192,
        },
        "workload": {"input_len": 512, "output_len": 128, "seed": 0},
        "arrival": {"concurrency": 8, "requests": 50},
        "budget": {"n_trials": 5},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _dry_run(job: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_CACHE": str(HUB), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tuner", "tune", "--dry-run", str(job)], capture_output=True, text=True, env=env
    )


def test_qwen3_8b_on_an_a10g_passes_the_dry_run_with_a_prediction(tmp_path: Path) -> None:
    out = _dry_run(_job(tmp_path, "Qwen/Qwen3-8B", "a10g"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Qwen/Qwen3-8B on NVIDIA A10G (22.19 GiB)" in out.stdout
    assert "baseline (vLLM's defaults)" in out.stdout and "KV tokens" in out.stdout
    assert "job file is valid; nothing was launched" in out.stdout


def test_an_unknown_gpu_named_with_its_memory_passes_the_dry_run(tmp_path: Path) -> None:
    out = _dry_run(_job(tmp_path, "Qwen/Qwen3-8B", {"name": "rtx-pro-6000", "memory_gib": 94.5}))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "KV tokens" in out.stdout
    assert "on rtx-pro-6000 (94.5 GiB)" in out.stdout


def test_an_unknown_architecture_passes_the_dry_run_without_a_prediction(tmp_path: Path) -> None:
    model = tmp_path / "qwen3-next"
    model.mkdir()
    shutil.copy(DATA / "configs" / "Qwen--Qwen3-Next-80B-A3B-Thinking.json", model / "config.json")
    out = _dry_run(_job(tmp_path, str(model), "h200"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refuse" not in out.stdout.lower() and "predicted not to start" not in out.stdout
    lines = out.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("baseline (vLLM's defaults)"))
    assert lines[at + 1].strip().removeprefix("-> ").startswith(NO_PREDICTION)  # launched to measure, never refused
    assert "of 64 random flag sets: 64 no prediction" in out.stdout
    assert "job file is valid; nothing was launched" in out.stdout


def test_a_cpu_target_is_shown_as_the_cpu_with_its_kv_space(tmp_path: Path) -> None:
    """`gpu: cpu`: the prediction uses the CPU build's KV space, and the report names no GPU (issue 11 item 4)."""
    doc = yaml.safe_load(_job(tmp_path, "Qwen/Qwen3-8B", "cpu").read_text())
    doc["target"]["launcher"] = "process"
    doc["space"] = {"max_num_seqs": {"choices": [4, 8]}, "max_model_len": 4096}
    job = tmp_path / "cpu.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = _dry_run(job)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Qwen/Qwen3-8B on CPU via process" in out.stdout and "GiB)" not in out.stdout.splitlines()[0]
    assert "KV tokens" in out.stdout
