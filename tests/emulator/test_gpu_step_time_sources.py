"""The roofline's GPU figures against the published ones: benchmarks/data/gpu_step_time_sources.json names the
source, software version and date of each, or says that it has none. A published figure with a `check` is run
through the emulator on the workload the source describes; its `emulator_error` (prediction / figure - 1) is what
the emulator gives today, kept true here, and `tolerance` is the band the tests hold it to."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tuner.catalog import ModelProfile, get_gpu, load_model
from tuner.emulator.simulate import simulate_closed_loop
from tuner.emulator.step_time import StepTimeModel
from tuner.flags import VllmFlags, resolve

SOURCES = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gpu_step_time_sources.json"
LLAMA = load_model("llama-3.1-8b")
# how far the emulator's error may drift from the recorded one before the file has to be brought up to date
ERROR_DRIFT = 0.02


@cache
def _data() -> dict[str, Any]:
    return json.loads(SOURCES.read_text())  # type: ignore[no-any-return]


def _figures() -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in _data()["figures"]}


def _checked() -> list[str]:
    return [fid for fid, f in _figures().items() if "check" in f]


def _model(name: str) -> ModelProfile:
    configs = _data()["model_configs"]
    if name in configs:
        return ModelProfile.from_config(configs[name]["name"], configs[name]["config"])
    return load_model(name)


def _metric(check: dict[str, Any], concurrency: int) -> float:
    r = simulate_closed_loop(
        _model(check["model"]),
        get_gpu(check["gpu"]),
        VllmFlags(**check.get("flags", {})),
        concurrency=concurrency,
        input_len=check["input_len"],
        output_len=check["output_len"],
        requests=check.get("requests_per_client", 4) * concurrency,
    )
    metric = check["metric"]
    if metric == "tpot_mean_ms":
        return r.tpot_mean_s * 1e3
    if metric == "ttft_mean_ms":
        return r.ttft_mean_s * 1e3
    if metric == "output_tok_s":
        return r.output_tok_s
    if metric == "total_tok_s":  # prompt and output tokens over the run, as vllm bench's "Total token throughput"
        return r.output_tok_s * (check["input_len"] + check["output_len"]) / check["output_len"]
    raise AssertionError(f"unknown metric {metric!r}")


def predict(check: dict[str, Any]) -> float:
    """What the emulator says for a figure's `check`: the metric at `concurrency` closed-loop clients, or its ratio
    to the same run at `over_concurrency` clients."""
    value = _metric(check, check["concurrency"])
    if "over_concurrency" in check:
        value /= _metric(check, check["over_concurrency"])
    return value


def _decode_step(gpu: str, context: int) -> float:
    g = get_gpu(gpu)
    step = StepTimeModel.build(LLAMA, g, resolve(VllmFlags(max_model_len=8192), g, LLAMA))
    return step.decode_step_seconds(1, context)


def test_every_figure_says_where_it_comes_from() -> None:
    for fid, f in _figures().items():
        assert f["status"] in ("published", "derived", "no source"), fid
        assert f["source"], fid
        if f["status"] == "published":
            assert f.get("software") and f.get("date") and f.get("workload"), fid
            assert "value" in f and f.get("tolerance") is not None and "emulator_error" in f, fid
            # a tolerance states the error it tolerates: no wider than the recorded error and a margin
            assert abs(f["emulator_error"]) <= f["tolerance"] <= abs(f["emulator_error"]) + 0.05, fid


def test_a100_batch_one_decode_is_within_its_tolerance_of_the_published_measurement() -> None:
    f = _figures()["a100-40gb-decode-batch1"]
    tok_s = 1 / _decode_step("a100-40gb", 1024 + 64)  # half-way through the 128 output tokens
    error = tok_s / f["value"] - 1
    assert abs(error) <= f["tolerance"]
    assert abs(error - f["emulator_error"]) <= ERROR_DRIFT


@pytest.mark.parametrize("fid", _checked())
def test_published_figure_against_the_emulator_on_its_workload(fid: str) -> None:
    f = _figures()[fid]
    error = predict(f["check"]) / f["value"] - 1
    assert abs(error) <= f["tolerance"], f"{fid}: the emulator is {error:+.1%} off the published {f['value']}"
    assert abs(error - f["emulator_error"]) <= ERROR_DRIFT, (
        f"{fid}: the emulator is now {error:+.1%} off, the file says {f['emulator_error']:+.1%}: bring it up to date"
    )


def test_the_derived_ranges_hold() -> None:
    figures = _figures()
    low, high = figures["h100-decode-batch1"]["range"]
    assert low <= _decode_step("h100-80gb", 640) <= high
    low, high = figures["rtx4090-decode-batch1"]["range"]
    assert low <= 1 / _decode_step("rtx4090", 640) <= high
    assert _decode_step("a100-40gb", 640) / _decode_step("h100-80gb", 640) > figures["a100-over-h100-decode"]["value"]


AIC = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "aic_step_times.json"
# Cards whose AIC data is for a recent vLLM (0.24) and whose step the roofline is brought to; the A100's data is
# vLLM 0.14 and the L40S's GEMMs run below its datasheet peak (benchmarks/README.md says why they are wider).
AIC_CARDS = {"h100-80gb": (0.10, 0.18), "h200": (0.10, 0.18), "b200": (0.10, 0.18)}  # decode, prefill bands


def _aic_pairs() -> list[dict[str, Any]]:
    return [p for p in json.loads(AIC.read_text())["pairs"] if p["gpu"] in AIC_CARDS]


@pytest.mark.parametrize("pair", _aic_pairs(), ids=lambda p: f"{p['gpu']}-{p['model']}")
def test_gpu_step_time_is_within_its_band_of_aiconfigurators_measured_kernels(pair: dict[str, Any]) -> None:
    """benchmarks/aic_compare.py's figures, kept in the repository so the check runs without AIConfigurator."""
    model, gpu = load_model(pair["model"]), get_gpu(pair["gpu"])
    step = StepTimeModel.build(
        model, gpu, resolve(VllmFlags(max_model_len=16384, tensor_parallel_size=pair["tp"]), gpu, model)
    )
    decode_band, prefill_band = AIC_CARDS[pair["gpu"]]
    for batch, context, aic in pair["decode"]:
        ratio = step.decode_step_seconds(batch, context) / aic
        assert abs(ratio - 1) <= decode_band, f"decode at batch {batch}, {context} tokens: {ratio:.2f} x AIC's"
    for tokens, aic in pair["prefill"]:
        ratio = step.prefill_seconds(tokens) / aic
        assert abs(ratio - 1) <= prefill_band, f"prefill of {tokens} tokens: {ratio:.2f} x AIC's"
