from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from tuner.catalog import get_gpu, load_model
from tuner.errors import ConfigError
from tuner.space import Choices, Range, SearchSpace

GPU = get_gpu("l4")
MODEL = load_model("llama-3.1-8b")


def build(spec: dict[str, object], longest: int | None = None) -> SearchSpace:
    return SearchSpace.build(spec, GPU, MODEL, longest_request=longest)  # type: ignore[arg-type]


def test_ranges_choices_and_fixed_compile_to_optuna_distributions() -> None:
    space = build(
        {
            "max_num_seqs": Range(low=8, high=128, log=True),
            "gpu_memory_utilization": Range(low=0.8, high=0.95, step=0.05),
            "max_num_batched_tokens": Choices(choices=[2048, "4K"]),
            "max_model_len": "8K",
            "enable_prefix_caching": Choices(choices=[True, False]),
        }
    )
    assert space.distributions["max_num_seqs"] == IntDistribution(8, 128, log=True)
    assert space.distributions["gpu_memory_utilization"] == FloatDistribution(0.8, 0.95, step=0.05)
    assert space.distributions["max_num_batched_tokens"] == CategoricalDistribution([2048, 4096])
    assert space.fixed == {"max_model_len": 8192}
    # Suggestion order is fixed, whatever order the job file lists the flags in.
    assert list(space.distributions)[:3] == ["max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"]


def test_suggest_applies_vllms_batched_tokens_rule_before_launch() -> None:
    space = build({"max_num_seqs": Range(low=8, high=512), "max_num_batched_tokens": Range(low=64, high=8192)})
    s = space.suggest(optuna.trial.FixedTrial({"max_num_seqs": 256, "max_num_batched_tokens": 100}))
    assert s.flags.max_num_seqs == 256 and s.flags.max_num_batched_tokens == 256
    assert s.params == {"max_num_seqs": 256, "max_num_batched_tokens": 100}
    assert "must" not in s.repairs[0] or ">= max_num_seqs" in s.repairs[0]
    # A sampled max_num_seqs above vLLM's default token budget (2048 on an L4) raises the budget too.
    only_seqs = build({"max_num_seqs": Range(low=8, high=4096)})
    s = only_seqs.suggest(optuna.trial.FixedTrial({"max_num_seqs": 3000}))
    assert s.flags.max_num_batched_tokens == 3000


def test_chunked_prefill_off_needs_budget_of_max_model_len() -> None:
    space = build({"max_num_batched_tokens": Range(low=512, high=8192), "enable_chunked_prefill": False})
    s = space.suggest(optuna.trial.FixedTrial({"max_num_batched_tokens": 1024}))
    assert s.flags.max_num_batched_tokens == MODEL.max_position_embeddings


def test_max_model_len_range_is_clipped_at_the_models_limit() -> None:
    space = build({"max_model_len": Range(low=4096, high=262144)})
    dist = space.distributions["max_model_len"]
    assert isinstance(dist, IntDistribution) and dist.high == 131072
    assert any("clipped" in n for n in space.notes)
    with pytest.raises(ConfigError, match=r"space.max_model_len: the whole range is above the model's limit"):
        build({"max_model_len": Range(low=200000, high=262144)})
    with pytest.raises(ConfigError, match=r"space.max_model_len: 200000 is above the model's limit \(131072"):
        build({"max_model_len": 200000, "max_num_seqs": Range(low=1, high=2)})


def test_short_max_model_len_is_flagged() -> None:
    space = build({"max_model_len": Choices(choices=[1024, 8192])}, longest=2048)
    assert any("below the workload's longest request (2048" in n for n in space.notes)
    s = space.suggest(optuna.trial.FixedTrial({"max_model_len": 1024}))
    assert s.warnings and "HTTP 400" in s.warnings[0]
    assert not space.suggest(optuna.trial.FixedTrial({"max_model_len": 8192})).warnings


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"gpu_memory_utilization": Range(low=0.5, high=1.2)}, r"gpu_memory_utilization is a fraction in \(0, 1\]"),
        ({"enforce_eager": Range(low=0, high=1)}, "takes `choices` or a fixed value"),
        ({"kv_cache_dtype": Choices(choices=["fp4"])}, "use one of auto, fp8"),
        ({"block_size": Choices(choices=[16, 24])}, "block_size is one of"),
        ({"tensor_parallel_size": Choices(choices=[1, 3])}, "must divide the model's 32 attention heads"),
        ({"max_num_seqs": Range(low=64, high=8)}, r"low \(64\) must be <= high \(8\)"),
        ({"max_num_seqs": Range(low=1.5, high=8)}, "takes integers"),
        ({"max_model_len": Range(low="8x", high=8192)}, "invalid length '8x'"),
        ({"Bad-Name": 3}, "not a vLLM flag name"),
        ({"max_model_len": 8192}, "nothing to tune"),
    ],
)
def test_bad_space_names_the_flag_and_what_is_allowed(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(spec)


def test_baseline_is_vllms_defaults_with_the_jobs_fixed_flags() -> None:
    space = build({"max_num_seqs": Range(low=8, high=128), "max_model_len": 8192})
    base = space.baseline()
    assert base.max_num_seqs == 256  # vLLM's default on an L4, outside the range: the baseline is the default
    assert base.max_num_batched_tokens == 2048 and base.gpu_memory_utilization == 0.9
    assert base.max_model_len == 8192  # fixed by the job
    assert space.baseline_params() == {"max_num_seqs": 256}
    trial = optuna.trial.FixedTrial(space.baseline_params())
    s = space.suggest(trial, baseline=True)
    assert s.flags == base and s.params == {"max_num_seqs": 256}


def test_extra_flags_pass_through_and_grid_enumerates() -> None:
    space = build({"max_num_seqs": Range(low=16, high=64, step=16), "swap_space": Choices(choices=[4, 8])})
    assert space.grid() == {"max_num_seqs": [16, 32, 48, 64], "swap_space": [4, 8]}
    s = space.suggest(optuna.trial.FixedTrial({"max_num_seqs": 32, "swap_space": 8}))
    assert s.flags.extra == {"swap_space": 8}
    assert "--swap-space" in s.flags.to_args()
    with pytest.raises(ConfigError, match="grid sampler needs a finite set"):
        build({"gpu_memory_utilization": Range(low=0.8, high=0.9)}).grid()


def test_float_step_that_does_not_divide_is_landed_with_a_note() -> None:
    space = build({"gpu_memory_utilization": Range(low=0.8, high=0.97, step=0.05)})
    assert space.distributions["gpu_memory_utilization"] == FloatDistribution(0.8, 0.95, step=0.05)
    assert any("high lowered to 0.95" in n for n in space.notes)
