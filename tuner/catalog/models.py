"""Model profiles: read from a Hugging Face `config.json`, or one of a few built-in profiles.

Only what the memory arithmetic and the step-time model need: layer and head geometry, vocabulary, context
limit, weight dtype and quantisation. Parameter count is derived from the geometry, as the weights' size is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES.get(self.dtype, 2)

    @property
    def embedding_params(self) -> int:
        n = self.vocab_size * self.hidden_size
        return n if self.tie_word_embeddings else 2 * n

    @property
    def layer_params(self) -> int:
        q = self.hidden_size * self.num_attention_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (q + kv + o + mlp + 2 * self.hidden_size)

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.layer_params + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights on the GPU(s), all tensor-parallel ranks together."""
        if self.quantization in ("awq", "gptq") and self.quant_bits < 16:
            # packed ints plus one fp16 scale and zero per group of 128: ~0.25 bit a weight
            linear = self.layer_params * (self.quant_bits + 0.25) / 8
            return int(linear + self.embedding_params * 2)
        if self.quantization == "fp8":
            return int(self.layer_params * 1 + self.embedding_params * 2)
        return (self.num_params) * self.dtype_bytes

    def kv_bytes_per_token(self, kv_dtype_bytes: int | None = None) -> int:
        """2 (K and V) x layers x KV heads x head dim x dtype bytes, summed over tensor-parallel ranks."""
        b = kv_dtype_bytes if kv_dtype_bytes is not None else self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * b

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> ModelProfile:
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            quant = config.get("quantization_config") or {}
            method = quant.get("quant_method")
            return cls(
                name=name,
                num_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
                dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
                quantization=str(method) if method else None,
                quant_bits=int(quant.get("bits", 8 if method == "fp8" else 16)) if method else 16,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise CatalogError(f"model config of {name!r} lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CatalogError(f"model config of {name!r} has a bad value: {e}") from None


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


def load_model(name_or_path: str) -> ModelProfile:
    """A built-in profile by name (or its hub name), or a directory / file holding a `config.json`."""
    key = name_or_path.strip().lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    if key in _ALIASES:
        return BUILTIN_MODELS[_ALIASES[key]]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CatalogError(f"cannot read model config {path}: {e}") from None
        if not isinstance(config, dict):
            raise CatalogError(f"model config {path} is not a JSON object")
        return ModelProfile.from_config(str(path.parent if path.name == "config.json" else path), config)
    raise CatalogError(
        f"unknown model {name_or_path!r}: not a built-in profile ({', '.join(BUILTIN_MODELS)}) "
        "and not a directory with a config.json"
    )
