"""vLLM's launch flags as one typed object: vLLM's names, vLLM's defaults, vLLM's argument validation.

`VllmFlags` is what a trial proposes and what every launcher, the emulator and every export consume.
Unset fields mean "vLLM's default"; `resolve()` fills them the way `EngineArgs._set_default_args` does for
the OpenAI server on a given GPU and model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tuner.catalog.gpus import GpuProfile
from tuner.catalog.models import ModelProfile

BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
TUNED_FLAGS = ("max_num_seqs", "max_model_len", "gpu_memory_utilization", "max_num_batched_tokens")

ExtraValue = str | int | float | bool


class VllmFlags(BaseModel):
    """A set of `vllm serve` flags. `None` = leave it to vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    enforce_eager: bool = False
    extra: dict[str, ExtraValue] = Field(default_factory=dict)

    def to_args(self) -> list[str]:
        """The flags as `vllm serve` arguments (only those set away from vLLM's defaults)."""
        args: list[str] = []
        for name in (*TUNED_FLAGS, "tensor_parallel_size", "kv_cache_dtype", "block_size"):
            value = getattr(self, name)
            default = {"tensor_parallel_size": 1, "kv_cache_dtype": "auto", "block_size": 16}.get(name)
            if value is not None and value != default:
                args += [flag_name(name), str(value)]
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            value = getattr(self, name)
            if value is not None:
                args.append(flag_name(name) if value else flag_name("no_" + name))
        if self.enforce_eager:
            args.append("--enforce-eager")
        for name, value in self.extra.items():
            if isinstance(value, bool):
                args.append(flag_name(name) if value else flag_name("no_" + name))
            else:
                args += [flag_name(name), str(value)]
        return args

    def as_dict(self) -> dict[str, Any]:
        """Only the fields that are set, with `extra` flattened in: the trial's parameters."""
        d = {k: v for k, v in self.model_dump(exclude={"extra"}).items() if v is not None}
        for k, default in (
            ("tensor_parallel_size", 1),
            ("kv_cache_dtype", "auto"),
            ("block_size", 16),
            ("enforce_eager", False),
        ):
            if d.get(k) == default:
                d.pop(k)
        return d | dict(self.extra)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> VllmFlags:
        known = set(cls.model_fields) - {"extra"}
        return cls(
            **{k: v for k, v in params.items() if k in known}, extra={k: v for k, v in params.items() if k not in known}
        )


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class ResolvedFlags:
    """Every flag with a value, after vLLM's defaulting rules."""

    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    tensor_parallel_size: int
    kv_cache_dtype: str
    block_size: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    enforce_eager: bool

    @property
    def kv_dtype_bytes(self) -> int | None:
        return 1 if self.kv_cache_dtype.startswith("fp8") else None


def default_flags(gpu: GpuProfile, model: ModelProfile) -> VllmFlags:
    """vLLM's own defaults for this GPU and model, written out: the baseline trial."""
    r = resolve(VllmFlags(), gpu, model)
    return VllmFlags(
        max_num_seqs=r.max_num_seqs,
        # a config without a context limit: vLLM derives its own, so the baseline leaves it to vLLM
        max_model_len=r.max_model_len if model.context_from_config else None,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_batched_tokens=r.max_num_batched_tokens,
    )


# vLLM's CPU platform: its server defaults (EngineArgs.get_batch_defaults, "cpu specific default values", per
# tensor-parallel rank) and its block size when none is given (CpuPlatform.check_and_update_config).
CPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_SEQS = 128
CPU_BLOCK_SIZE = 128
_DEFAULT_BLOCK_SIZE = VllmFlags.model_fields["block_size"].default


def resolve(flags: VllmFlags, gpu: GpuProfile, model: ModelProfile) -> ResolvedFlags:
    high = gpu.is_high_end
    if gpu.is_cpu:
        tp = flags.tensor_parallel_size
        batched = flags.max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS * tp
        seqs = flags.max_num_seqs or CPU_MAX_NUM_SEQS * tp
    elif gpu.is_largest:
        # vLLM 0.32's EngineArgs.get_batch_defaults: >= 160 GiB (B200, MI300X) gets 16384 tokens for the server too
        batched = flags.max_num_batched_tokens or 16384
        seqs = flags.max_num_seqs or min(1024, batched)
    else:
        batched = flags.max_num_batched_tokens or (8192 if high else 2048)
        seqs = flags.max_num_seqs or min(1024 if high else 256, batched)
    # `to_args` leaves the default block size out, so on a CPU vLLM picks its own.
    block = CPU_BLOCK_SIZE if gpu.is_cpu and flags.block_size == _DEFAULT_BLOCK_SIZE else flags.block_size
    return ResolvedFlags(
        max_num_seqs=seqs,
        max_model_len=flags.max_model_len or model.max_position_embeddings,
        gpu_memory_utilization=0.9 if flags.gpu_memory_utilization is None else flags.gpu_memory_utilization,
        max_num_batched_tokens=batched,
        tensor_parallel_size=flags.tensor_parallel_size,
        kv_cache_dtype=flags.kv_cache_dtype,
        block_size=block,
        # V1 always chunks prefill for generative models and caches prefixes unless told not to.
        enable_chunked_prefill=True if flags.enable_chunked_prefill is None else flags.enable_chunked_prefill,
        enable_prefix_caching=True if flags.enable_prefix_caching is None else flags.enable_prefix_caching,
        enforce_eager=flags.enforce_eager,
    )


def validate(flags: ResolvedFlags, model: ModelProfile) -> str | None:
    """vLLM's config checks, in its order; the first failing one's message (vLLM's words), or None."""
    u = flags.gpu_memory_utilization
    if not 0 < u <= 1:
        return f"GPU memory utilization must be less than 1.0. Got {u}."
    if model.context_from_config and flags.max_model_len > model.max_position_embeddings:
        return (
            f"User-specified max_model_len ({flags.max_model_len}) is greater than the derived max_model_len "
            f"(max_position_embeddings={model.max_position_embeddings} or model_max_length=None in model's "
            "config.json). To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative "
            "position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the model uses "
            "absolute position encoding, positions exceeding derived_max_model_len will cause a CUDA array "
            "out-of-bounds error."
        )
    if flags.max_model_len < 1 or flags.max_num_seqs < 1 or flags.max_num_batched_tokens < 1:
        return "max_model_len, max_num_seqs and max_num_batched_tokens must be positive integers."
    if flags.max_num_batched_tokens < flags.max_num_seqs:
        return (
            f"max_num_batched_tokens ({flags.max_num_batched_tokens}) must be greater than or equal to "
            f"max_num_seqs ({flags.max_num_seqs})."
        )
    if not flags.enable_chunked_prefill and flags.max_num_batched_tokens < flags.max_model_len:
        return (
            f"max_num_batched_tokens ({flags.max_num_batched_tokens}) is smaller than max_model_len "
            f"({flags.max_model_len}). This effectively limits the maximum sequence length to "
            "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
            "max_num_batched_tokens or decrease max_model_len."
        )
    if model.num_attention_heads % flags.tensor_parallel_size:
        return (
            f"Total number of attention heads ({model.num_attention_heads}) must be divisible by tensor "
            f"parallel size ({flags.tensor_parallel_size})."
        )
    if flags.block_size not in BLOCK_SIZES:
        return f"argument --block-size: invalid choice: {flags.block_size} (choose from {list(BLOCK_SIZES)})"
    if flags.kv_cache_dtype not in KV_CACHE_DTYPES:
        return (
            f"argument --kv-cache-dtype: invalid choice: '{flags.kv_cache_dtype}' "
            f"(choose from {', '.join(repr(d) for d in KV_CACHE_DTYPES)})"
        )
    return None


_LEN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_model_len(text: str) -> int:
    """vLLM's human-readable lengths: `1k` = 1000, `1K` = 1024, `1m` = 10^6, `1M` = 2^20."""
    m = _LEN.match(text)
    if not m:
        raise ValueError(f"invalid length {text!r}: use an integer or a number with k/K/m/M (e.g. 8192, 8k, 32K)")
    number, unit = float(m.group(1)), m.group(2)
    mult = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 2**20}[unit]
    return int(number * mult)
