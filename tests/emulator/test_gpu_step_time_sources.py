"""The roofline's GPU figures against the published ones: benchmarks/data/gpu_step_time_sources.json names the
source, software version and date of each, or says that it has none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tuner.catalog import get_gpu, load_model
from tuner.emulator.step_time import StepTimeModel
from tuner.flags import VllmFlags, resolve

SOURCES = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gpu_step_time_sources.json"
LLAMA = load_model("llama-3.1-8b")


def _figures() -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in json.loads(SOURCES.read_text())["figures"]}


def _decode_step(gpu: str, context: int) -> float:
    g = get_gpu(gpu)
    step = StepTimeModel.build(LLAMA, g, resolve(VllmFlags(max_model_len=8192), g, LLAMA))
    return step.decode_step_seconds(1, context)


def test_every_figure_says_where_it_comes_from() -> None:
    for fid, f in _figures().items():
        assert f["status"] in ("published", "derived", "no source"), fid
        assert f["source"], fid
        if f["status"] == "published":
            assert f.get("software") and f.get("date"), fid


def test_a100_batch_one_decode_is_within_its_tolerance_of_the_published_measurement() -> None:
    f = _figures()["a100-40gb-decode-batch1"]
    tok_s = 1 / _decode_step("a100-40gb", 1024 + 64)  # half-way through the 128 output tokens
    assert abs(tok_s / f["value"] - 1) <= f["tolerance"]


def test_the_derived_ranges_hold() -> None:
    figures = _figures()
    low, high = figures["h100-decode-batch1"]["range"]
    assert low <= _decode_step("h100-80gb", 640) <= high
    low, high = figures["rtx4090-decode-batch1"]["range"]
    assert low <= 1 / _decode_step("rtx4090", 640) <= high
    assert _decode_step("a100-40gb", 640) / _decode_step("h100-80gb", 640) > figures["a100-over-h100-decode"]["value"]
