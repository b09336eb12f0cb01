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
    # --async-scheduling / --no-async-scheduling; None: vLLM decides (on for a GPU server, never on the CPU build)
    async_scheduling: bool | None = None
    # vLLM's --kv-cache-memory-bytes: the KV cache's size given outright (no profiling, utilization ignored)
    kv_cache_memory_bytes: int | None = None
    extra: dict[str, ExtraValue] = Field(default_factory=dict)

    def to_args(self) -> list[str]:
        """The flags as `vllm serve` arguments (only those set away from vLLM's defaults)."""
        args: list[str] = []
        for name in (*TUNED_FLAGS, "tensor_parallel_size", "kv_cache_dtype", "block_size"):
            value = getattr(self, name)
            default = {"tensor_parallel_size": 1, "kv_cache_dtype": "auto", "block_size": 16}.get(name)
            if value is not None and value != default:
                args += [flag_name(name), str(value)]
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "async_scheduling"):
            value = getattr(self, name)
            if value is not None:
                args.append(flag_name(name) if value else flag_name("no_" + name))
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.kv_cache_memory_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        for name, value in self.extra.items():
            if isinstance(value, bool):
                args.append(flag_name(name) if value else flag_name("no_" + name))
            else:
                args += [flag_name(name), str(value)]
        return args

    @property
    def world_size(self) -> int:
        """The GPUs one server needs: tensor x pipeline parallel size (vllm/config/parallel.py,
        ParallelConfig.world_size)."""
        pp = self.extra.get("pipeline_parallel_size", 1)
        return max(1, int(self.tensor_parallel_size)) * max(1, int(pp) if isinstance(pp, int | float | str) else 1)

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
    kv_cache_memory_bytes: int | None = None
    # `--max-model-len auto` (or -1): max_model_len is the model's own limit until the start fits it to memory
    auto_max_model_len: bool = False
    # the scheduler decides step N+1 while step N runs (see async_scheduling_default)
    async_scheduling: bool = True

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


AUTO_MAX_MODEL_LEN = -1  # vLLM's `--max-model-len auto` / `-1`: fit the longest request the KV cache holds


def async_scheduling_default(gpu: GpuProfile, given: bool | None) -> bool:
    """Whether vLLM 0.32.0 schedules asynchronously. VllmConfig.__post_init__ (vllm/config/vllm.py) turns it on
    when the flag is left unset, unless something incompatible is (a pooling model, speculative decoding other than
    EAGLE/MTP/n-gram/draft model, pipeline parallelism on the V1 model runner: none of them a flag the tuner sets);
    CpuPlatform.check_and_update_config (vllm/platforms/cpu.py), which runs after it and "has the last word", sets
    it off on the CPU build whatever the flag says ("async scheduling is not required on CPU")."""
    if gpu.is_cpu:
        return False
    return True if given is None else given


def batch_defaults(gpu: GpuProfile, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """vLLM's server defaults (max_num_batched_tokens, max_num_seqs) for this device (EngineArgs.get_batch_defaults
    in vllm/engine/arg_utils.py, 0.32.0, usage context OPENAI_API_SERVER): >= 160 GiB 16384/1024; >= 70 GiB and
    not an A100 8192/1024; other GPUs 2048/256; the CPU platform 2048/128 a rank."""
    if gpu.is_cpu:
        return CPU_MAX_NUM_BATCHED_TOKENS * tensor_parallel_size, CPU_MAX_NUM_SEQS * tensor_parallel_size
    if gpu.is_largest:
        return 16384, 1024
    if gpu.is_high_end:
        return 8192, 1024
    return 2048, 256


def resolve(flags: VllmFlags, gpu: GpuProfile, model: ModelProfile) -> ResolvedFlags:
    auto_len = flags.max_model_len == AUTO_MAX_MODEL_LEN
    max_len = model.max_position_embeddings if auto_len or not flags.max_model_len else flags.max_model_len
    # V1 chunks prefill for generative models and caches prefixes unless told not to.
    chunked = True if flags.enable_chunked_prefill is None else flags.enable_chunked_prefill
    default_batched, default_seqs = batch_defaults(gpu, flags.tensor_parallel_size)
    seqs = flags.max_num_seqs or default_seqs
    batched = flags.max_num_batched_tokens
    if batched is None:  # EngineArgs._set_default_args, in its order
        batched = default_batched
        if not chunked:  # a whole prompt must fit one step
            batched = max(max_len, batched)
        batched = min(seqs * max_len, batched)
    if flags.max_num_seqs is None:
        seqs = min(seqs, batched)
    # `to_args` leaves the default block size out, so on a CPU vLLM picks its own.
    block = CPU_BLOCK_SIZE if gpu.is_cpu and flags.block_size == _DEFAULT_BLOCK_SIZE else flags.block_size
    return ResolvedFlags(
        max_num_seqs=seqs,
        max_model_len=max_len,
        gpu_memory_utilization=0.9 if flags.gpu_memory_utilization is None else flags.gpu_memory_utilization,
        max_num_batched_tokens=batched,
        tensor_parallel_size=flags.tensor_parallel_size,
        kv_cache_dtype=flags.kv_cache_dtype,
        block_size=block,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=True if flags.enable_prefix_caching is None else flags.enable_prefix_caching,
        enforce_eager=flags.enforce_eager,
        kv_cache_memory_bytes=flags.kv_cache_memory_bytes,
        auto_max_model_len=auto_len,
        async_scheduling=async_scheduling_default(gpu, flags.async_scheduling),
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


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(text: str, what: str = "integer") -> int:
    """vLLM's human-readable integers (human_readable_int in vllm/utils/argparse_utils.py, 0.32.0): k/m/g/t are
    powers of 1000 and take decimals (`25.6k` = 25600), K/M/G/T powers of 1024 and do not (`1.5K` is refused)."""
    value = text.strip()
    m = _HUMAN_INT.fullmatch(value)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise ValueError(
                f"invalid {what} {text!r}: decimals are not allowed with binary suffixes like "
                f"{suffix}; did you mean {number}{suffix.lower()}?"
            )
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"invalid {what} {text!r}: use an integer or a number with k/m/g/t (x1000) or K/M/G/T (x1024), "
            "e.g. 8192, 8k, 32K"
        ) from None


def parse_model_len(text: str) -> int:
    """`--max-model-len`: a human-readable integer, or `auto` / `-1` (AUTO_MAX_MODEL_LEN: fit it to the KV cache;
    human_readable_int_or_auto)."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        return AUTO_MAX_MODEL_LEN
    return parse_human_int(value, "length")
