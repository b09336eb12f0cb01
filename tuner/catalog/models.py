"""Model profiles: any Hugging Face model (its `config.json` from a directory, the local cache or the hub), or one
of a few built-in profiles.

Only what the memory arithmetic and the step-time model need: layer and head geometry, the KV cache's layer groups
(full, sliding-window, latent), MoE, vocabulary, context limit, weight dtype and quantisation. The weights' size is
the safetensors index's `metadata.total_size` when there is one, else derived from the geometry. A config whose
architecture the arithmetic does not know still loads, with `predictable=False`: it is launched without a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuner.catalog.architectures import (
    Architecture,
    LayerGroup,
    MlaShape,
    MoeShape,
    UnknownArchitecture,
    read_architecture,
    text_config,
)
from tuner.catalog.hub import locate
from tuner.errors import CatalogError

GIB = 1024**3
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class ModelProfile:
    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "bfloat16"
    quantization: str | None = None  # e.g. "awq", "gptq", "fp8"
    quant_bits: int = 16
    tie_word_embeddings: bool = False
    # The KV cache's layer groups; empty means every layer is full attention of num_kv_heads x head_dim.
    kv_groups: tuple[LayerGroup, ...] = ()
    moe: MoeShape | None = None
    mla: MlaShape | None = None
    checkpoint_bytes: int | None = None  # the safetensors index's metadata.total_size, as loaded (bf16 for fp32)
    architecture: str | None = None
    multimodal: bool = False
    # False: the arithmetic does not know this architecture (why in `unknown_reason`); no prediction is made.
    predictable: bool = True
    unknown_reason: str | None = None
    context_from_config: bool = True  # max_position_embeddings came from the config, not a stand-in

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES.get(self.dtype, 2)

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        if self.kv_groups:
            return self.kv_groups
        return (LayerGroup(self.num_layers, self.num_kv_heads, self.head_dim, self.head_dim),)

    @property
    def embedding_params(self) -> int:
        n = self.vocab_size * self.hidden_size
        return n if self.tie_word_embeddings else 2 * n

    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.mla is not None:  # DeepSeek MLA: q (low rank or not), kv_a, kv_b, o
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            heads = self.num_attention_heads
            q = (h * m.q_lora_rank + m.q_lora_rank * heads * qk) if m.q_lora_rank else h * heads * qk
            kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)
            kv = kv_a + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + heads * m.v_head_dim * h
        q = h * self.num_attention_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * h
        return q + kv + o

    def _mlp_params(self, active: bool) -> int:
        h = self.hidden_size
        dense = 3 * h * self.intermediate_size
        if self.moe is None:
            return self.num_layers * dense
        m = self.moe
        experts = m.experts_per_token if active else m.num_experts
        router = h * m.num_experts
        moe_layer = experts * 3 * h * m.expert_intermediate_size + 3 * h * m.shared_intermediate_size + router
        return m.moe_layers * moe_layer + (self.num_layers - m.moe_layers) * dense

    @property
    def layer_params(self) -> int:
        """Every decoder layer's parameters; an MoE's are all its experts' (vLLM loads them all)."""
        norms = 2 * self.hidden_size
        return self.num_layers * (self._attention_params() + norms) + self._mlp_params(active=False)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: an MoE's routed experts only."""
        norms = 2 * self.hidden_size
        body = self.num_layers * (self._attention_params() + norms) + self._mlp_params(active=True)
        return self.embedding_params + body + self.hidden_size

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.layer_params + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights on the GPU(s), all tensor-parallel ranks together: the checkpoint's own size when its
        index gave one, else the arithmetic below."""
        if self.checkpoint_bytes:
            return self.checkpoint_bytes
        if self.quantization in ("awq", "gptq") and self.quant_bits < 16:
            # packed ints plus one fp16 scale and zero per group of 128: ~0.25 bit a weight
            linear = self.layer_params * (self.quant_bits + 0.25) / 8
            return int(linear + self.embedding_params * 2)
        if self.quantization == "fp8":
            return int(self.layer_params * 1 + self.embedding_params * 2)
        if self.quantization and self.quant_bits < 16:  # compressed-tensors, bitsandbytes, mxfp4, nvfp4, ...
            scales = 0.25 if self.quant_bits < 8 else 0.0
            return int(self.layer_params * (self.quant_bits + scales) / 8 + self.embedding_params * 2)
        return (self.num_params) * self.dtype_bytes

    def kv_bytes_per_token(self, kv_dtype_bytes: int | None = None) -> int:
        """KV bytes a token over every layer, summed over tensor-parallel ranks: K and V of each KV head
        (2 x layers x KV heads x head dim x dtype bytes), one latent a layer under MLA."""
        b = kv_dtype_bytes if kv_dtype_bytes is not None else self.dtype_bytes
        return sum(g.layers * g.bytes_per_token(b) for g in self.layer_groups)

    def kv_bytes_per_token_per_gpu(self, kv_dtype_bytes: int | None, tp: int) -> int:
        """The same on one of `tp` GPUs: KV heads split (never below one a rank), an MLA latent replicated."""
        b = kv_dtype_bytes if kv_dtype_bytes is not None else self.dtype_bytes
        return sum(g.layers * g.bytes_per_token(b, tp) for g in self.layer_groups)

    @classmethod
    def from_architecture(cls, name: str, arch: Architecture, checkpoint_bytes: int | None = None) -> ModelProfile:
        q = arch.quantization
        return cls(
            name=name,
            num_layers=arch.num_layers,
            num_attention_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            vocab_size=arch.vocab_size,
            max_position_embeddings=arch.max_position_embeddings or _STAND_IN_CONTEXT,
            dtype=arch.dtype,
            quantization=q.method if q else None,
            quant_bits=q.bits if q else 16,
            tie_word_embeddings=arch.tie_word_embeddings,
            kv_groups=arch.groups,
            moe=arch.moe,
            mla=arch.mla,
            checkpoint_bytes=checkpoint_bytes,
            architecture=arch.architecture,
            multimodal=arch.multimodal,
            context_from_config=arch.max_position_embeddings is not None,
        )

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any], checkpoint_bytes: int | None = None) -> ModelProfile:
        """A profile of any config.json. One whose architecture the arithmetic does not know comes back with
        `predictable=False` and stand-in geometry; only a file that is no model config at all is refused."""
        try:
            arch = read_architecture(config)
        except UnknownArchitecture as e:
            if not (config.get("model_type") or config.get("architectures")):
                if e.missing:
                    raise CatalogError(f"model config of {name!r} lacks the field {e.missing!r}") from None
                raise CatalogError(f"model config of {name!r}: {e}") from None
            return cls._unknown(name, config, str(e))
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
            raise CatalogError(f"model config of {name!r} has a bad value: {e}") from None
        if checkpoint_bytes and config_dtype_is_fp32(config) and not arch.quantization:
            checkpoint_bytes //= 2  # vLLM serves a float32 checkpoint in 16 bits
        return cls.from_architecture(name, arch, checkpoint_bytes)

    @classmethod
    def _unknown(cls, name: str, config: dict[str, Any], reason: str) -> ModelProfile:
        cfg = text_config(config)

        def num(key: str, default: int) -> int:
            value = cfg.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                return int(value)
            return default

        heads = num("num_attention_heads", 32)
        hidden = num("hidden_size", 4096)
        archs = config.get("architectures")
        max_pos = num("max_position_embeddings", 0)
        return cls(
            name=name,
            num_layers=num("num_hidden_layers", 32),
            num_attention_heads=heads,
            num_kv_heads=num("num_key_value_heads", heads),
            head_dim=num("head_dim", max(1, hidden // heads)),
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", 4 * hidden),
            vocab_size=num("vocab_size", 32000),
            max_position_embeddings=max_pos or _STAND_IN_CONTEXT,
            architecture=str(archs[0]) if isinstance(archs, list) and archs else str(config.get("model_type")),
            predictable=False,
            unknown_reason=reason,
            context_from_config=max_pos > 0,
        )


# A stand-in context limit for a config that gives none: vLLM derives its own, and the tuner then leaves
# --max-model-len unset in the baseline (ModelProfile.context_from_config is False).
_STAND_IN_CONTEXT = 131072


def config_dtype_is_fp32(config: dict[str, Any]) -> bool:
    cfg = text_config(config)
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "") in ("float32", "float")


_LLAMA_8B = dict(
    num_layers=32,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=131072,
)

BUILTIN_MODELS: dict[str, ModelProfile] = {
    "llama-3.1-8b": ModelProfile(name="meta-llama/Llama-3.1-8B-Instruct", **_LLAMA_8B),  # type: ignore[arg-type]
    "llama-3.1-8b-awq": ModelProfile(
        name="hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4",
        dtype="float16",
        quantization="awq",
        quant_bits=4,
        **_LLAMA_8B,  # type: ignore[arg-type]
    ),
    "llama-3.1-70b": ModelProfile(
        name="meta-llama/Llama-3.1-70B-Instruct",
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=131072,
    ),
    "qwen2.5-7b": ModelProfile(
        name="Qwen/Qwen2.5-7B-Instruct",
        num_layers=28,
        num_attention_heads=28,
        num_kv_heads=4,
        head_dim=128,
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
    ),
}

# Hub names people type, mapped to the built-in profiles (the emulator needs no download).
_ALIASES = {p.name.lower(): key for key, p in BUILTIN_MODELS.items()} | {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
}


def load_model(name_or_path: str, revision: str | None = None) -> ModelProfile:
    """A built-in profile by name (or its hub name), a directory / file holding a `config.json`, or a Hugging Face
    id (from the local cache, else the hub)."""
    key = name_or_path.strip().lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    if key in _ALIASES:
        return BUILTIN_MODELS[_ALIASES[key]]
    found = locate(name_or_path.strip(), revision)
    if found is None:
        raise CatalogError(
            f"unknown model {name_or_path!r}: not a built-in profile ({', '.join(BUILTIN_MODELS)}), "
            "not a directory with a config.json, and not a Hugging Face id (org/name)"
        )
    return ModelProfile.from_config(found.name, found.config, found.index_total_size)
