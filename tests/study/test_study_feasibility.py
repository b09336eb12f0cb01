from __future__ import annotations

from tuner.capacity import plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.feasibility import FeasibilityModel
from tuner.flags import VllmFlags, resolve

MODEL = load_model("llama-3.1-8b")


def test_prediction_is_vllms_arithmetic_before_any_start() -> None:
    gpu = get_gpu("rtx4090")
    fm = FeasibilityModel(gpu, MODEL)
    default = fm.predict(VllmFlags())  # max_model_len 131072 on 24 GB: vLLM refuses to start
    assert not default.ok and default.reason == "kv_cache_too_small"
    plan = plan_startup(MODEL, gpu, resolve(VllmFlags(), gpu, MODEL))
    # every block but the null one (check_enough_kv_cache_memory, 0.32)
    assert default.message == plan.message and default.estimated_max_model_len == plan.kv_tokens - 16
    good = fm.predict(VllmFlags(max_model_len=8192))
    assert good.ok and good.kv_tokens == good.raw_kv_tokens == plan.kv_tokens and good.kv_scale == 1.0


def test_reasons_that_do_not_depend_on_the_kv_estimate_are_kept() -> None:
    fm = FeasibilityModel(get_gpu("h100-80gb"), MODEL, memory_in_use_gib=20)
    p = fm.predict(VllmFlags(gpu_memory_utilization=0.9, max_model_len=8192))
    assert p.reason == "insufficient_free_memory"
    p = FeasibilityModel(get_gpu("l4"), MODEL).predict(VllmFlags(max_num_seqs=512, max_num_batched_tokens=256))
    assert p.reason == "invalid_flags" and "must be greater than or equal to max_num_seqs" in (p.message or "")


def test_calibration_scales_predicted_kv_by_observed_over_predicted() -> None:
    gpu = get_gpu("rtx4090")
    fm = FeasibilityModel(gpu, MODEL)
    flags = VllmFlags(max_model_len=8192)
    raw = fm.predict(flags).raw_kv_tokens
    # The real server logged 20% fewer KV tokens than our arithmetic: every later prediction shrinks too.
    fm.observe(raw, int(raw * 0.8))
    assert abs(fm.kv_scale - 0.8) < 1e-3
    p = fm.predict(flags)
    assert abs(p.kv_tokens - raw * 0.8) <= 16 and p.kv_tokens % 16 == 0
    # A max_model_len that fits the raw figure but not the calibrated one is now predicted to fail.
    tight = VllmFlags(max_model_len=int(raw * 0.9) // 16 * 16)
    assert FeasibilityModel(gpu, MODEL).predict(tight).ok
    verdict = fm.predict(tight)
    assert not verdict.ok and verdict.reason == "kv_cache_too_small" and "calibration" in (verdict.message or "")
    # ... and one that vLLM's arithmetic refuses but a roomier real GPU would take, is let through.
    roomy = FeasibilityModel(gpu, MODEL)
    roomy.observe(raw, int(raw * 1.3))
    assert roomy.predict(VllmFlags(max_model_len=int(raw * 1.2) // 16 * 16)).ok
    # Bad observations (a failed start logs no KV size) teach nothing.
    roomy.observe(None, 123)
    roomy.observe(raw, 0)
    assert roomy.observations == 1


def test_margin_lets_borderline_flag_sets_launch() -> None:
    gpu = get_gpu("rtx4090")
    raw = FeasibilityModel(gpu, MODEL).predict(VllmFlags(max_model_len=8192)).raw_kv_tokens
    just_over = VllmFlags(max_model_len=int(raw * 1.02) // 16 * 16)
    assert FeasibilityModel(gpu, MODEL, margin=0.0).predict(just_over).reason == "kv_cache_too_small"
    fm = FeasibilityModel(gpu, MODEL, margin=0.05)
    fm.observe(raw, raw)
    assert fm.predict(just_over).ok
