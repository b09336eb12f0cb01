"""A Hugging Face `config.json` read the way vLLM reads it: layer geometry, the KV cache's layer groups, MoE and
quantisation. Each rule names the vLLM (0.32) source it follows.

The KV cache of one layer, per token, is `kv_heads x (head_size + head_size_v) x dtype bytes`
(`AttentionSpec.state_content_size_bytes`, vllm/v1/kv_cache_interface.py):

- full attention (Llama, Qwen, Mistral, Mixtral, Qwen3-MoE): K and V, `head_size_v = head_size`, heads split over
  tensor-parallel ranks but never below one (`ModelConfig.get_num_kv_heads`);
- multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): one compressed latent a token,
  `head_size = kv_lora_rank + qk_rope_head_dim`, no V (`MLAAttentionSpec.head_size_v = 0`), one "head" on every rank
  (`get_num_kv_heads` returns 1 under MLA; `ModelArchConfigConvertor.get_head_size`);
- sliding-window layers (Gemma 2/3 every other / five of six layers, Mistral v0.1 all layers): the same bytes a
  token, but a request holds only the window's blocks (`SlidingWindowSpec.max_admission_blocks_per_request`).

What this module cannot read (state-space and linear-attention layers, indexer caches, encoder-decoder models, a
config without its geometry) raises `UnknownArchitecture`: such a model is launched without a prediction, never
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# vLLM's MLA model types with a plain latent cache (`is_deepseek_mla`, in
# transformers_utils/model_arch_config_convertor.py). deepseek_v32/v4, glm_moe_dsa and kimi_linear add indexer or
# linear-attention caches and are not predicted.
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite", "longcat_flash"})

# Layers whose state is not a paged attention cache (vLLM's MambaSpec and friends), by model type or layer type.
_STATE_SPACE_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "jamba",
        "bamba",
        "falcon_h1",
        "nemotron_h",
        "granitemoehybrid",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
        "kimi_linear",
        "minimax",
        "minimax_m1",
        "lfm2",
        "plamo2",
        "zamba2",
        "deepseek_v32",
        "deepseek_v4",
        "glm_moe_dsa",
        "llama4",  # chunked local attention: vLLM turns its hybrid KV manager off by default
    }
)
_ENCODER_DECODER_MODEL_TYPES = frozenset({"t5", "bart", "mbart", "whisper", "mllama", "pegasus", "marian"})
_KNOWN_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# transformers' own defaults for fields a published config may leave out (the config classes' __init__ defaults).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
    },
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "tie_word_embeddings": True},
    "gemma": {"head_dim": 256, "tie_word_embeddings": True},
}

# Keys under which a multimodal config keeps its language model (vLLM's `hf_text_config`).
_TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")


class UnknownArchitecture(Exception):
    """The config is a model's, but not one whose KV cache this arithmetic knows. `missing` names an absent field."""

    def __init__(self, reason: str, missing: str | None = None) -> None:
        super().__init__(reason)
        self.missing = missing


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one KV cache shape. `kv_heads` is the model's total (before tensor parallelism)."""

    layers: int
    kv_heads: int
    head_size: int
    head_size_v: int
    sliding_window: int | None = None
    latent: bool = False  # MLA: one latent a token, the same on every tensor-parallel rank

    def bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """One layer's KV bytes a token on one GPU."""
        heads = 1 if self.latent else max(1, self.kv_heads // tp)
        return heads * (self.head_size + self.head_size_v) * dtype_bytes


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int  # all shared experts together, 0 when none
    moe_layers: int


@dataclass(frozen=True)
class MlaShape:
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Quantization:
    method: str
    bits: int


@dataclass(frozen=True)
class Architecture:
    """What the arithmetic needs from one config."""

    model_type: str
    architecture: str | None
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None
    dtype: str
    tie_word_embeddings: bool
    groups: tuple[LayerGroup, ...]
    moe: MoeShape | None = None
    mla: MlaShape | None = None
    quantization: Quantization | None = None
    multimodal: bool = False

    @property
    def kind(self) -> str:
        if self.mla is not None:
            return "mla"
        windows = {g.sliding_window for g in self.groups}
        if windows == {None}:
            return "full"
        return "sliding" if None not in windows else "hybrid"


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: the nested text config of a multimodal model, with the top level's dtype and
    tying as fallbacks (vLLM's `hf_text_config`)."""
    for key in _TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, Mapping):
            merged = dict(nested)
            for inherited in ("torch_dtype", "dtype", "tie_word_embeddings", "quantization_config"):
                if inherited not in merged and inherited in config:
                    merged[inherited] = config[inherited]
            return merged
    return dict(config)


def _int(cfg: Mapping[str, Any], *names: str, default: int | None = None) -> int:
    for name in names:
        value = cfg.get(name)
        if value is not None:
            if isinstance(value, list):  # a few configs list a value per layer; vLLM takes the first
                value = value[0]
            return int(value)
    if default is None:
        raise UnknownArchitecture(f"the config has no {names[0]!r}", missing=names[0])
    return default


def _dtype(cfg: Mapping[str, Any]) -> str:
    raw = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    # vLLM's dtype "auto" downcasts a float32 checkpoint to the platform's first supported dtype
    # (config/model.py `_resolve_auto_dtype`): bf16 where it exists, fp16 otherwise; two bytes either way.
    return "bfloat16" if raw in ("float32", "float") else raw


def _layer_types(cfg: Mapping[str, Any], model_type: str, layers: int) -> list[str]:
    """Per layer "full_attention" or "sliding_attention", as transformers' config classes derive `layer_types`."""
    given = cfg.get("layer_types")
    if isinstance(given, list) and given:
        unknown = sorted({str(t) for t in given} - _KNOWN_LAYER_TYPES)
        if unknown:
            raise UnknownArchitecture(f"layer types {', '.join(unknown)} are not attention the arithmetic knows")
        return [str(t) for t in given[:layers]]
    window = cfg.get("sliding_window")
    if model_type == "gemma2":  # Gemma2Config: even layers slide, odd layers are global
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if model_type == "gemma3_text":  # Gemma3TextConfig: five sliding layers, then one global
        pattern = _int(cfg, "sliding_window_pattern", default=6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if model_type.startswith("qwen"):
        # Qwen2/Qwen3 configs keep a `sliding_window` they do not use: transformers sets it to None unless
        # use_sliding_window, and then only layers from max_window_layers on slide.
        if not cfg.get("use_sliding_window") or window is None:
            return ["full_attention"] * layers
        start = _int(cfg, "max_window_layers", default=layers)
        return ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    # Mistral v0.1, Phi-3 and others: vLLM applies the config's sliding_window to every layer
    # (Attention(per_layer_sliding_window=None) falls back to cache_config.sliding_window = hf_text_config's).
    return ["sliding_attention" if window else "full_attention"] * layers


def _quantization(cfg: Mapping[str, Any]) -> Quantization | None:
    q = cfg.get("quantization_config")
    if not isinstance(q, Mapping) or not q:
        return None
    method = str(q.get("quant_method") or q.get("quant_algo") or "unknown").lower()
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "auto-round", "autoround"):
        return Quantization(method.split("_")[0], int(q.get("bits", 4)))
    if method == "fp8" or method == "fbgemm_fp8":
        return Quantization("fp8", 8)
    if method == "bitsandbytes":
        return Quantization(method, 4 if q.get("load_in_4bit") else 8)
    if method in ("mxfp4", "nvfp4"):
        return Quantization(method, 4)
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).lower()
        return Quantization("modelopt", 4 if "fp4" in algo else 8)
    if method == "compressed-tensors":
        bits = 8
        groups = q.get("config_groups")
        if isinstance(groups, Mapping):
            for group in groups.values():
                weights = group.get("weights") if isinstance(group, Mapping) else None
                if isinstance(weights, Mapping) and weights.get("num_bits"):
                    bits = int(weights["num_bits"])
                    break
        return Quantization(method, bits)
    return Quantization(method, int(q.get("bits", 8)))


def _moe(cfg: Mapping[str, Any], layers: int, intermediate: int, model_type: str) -> MoeShape | None:
    # vLLM's names for the expert count (get_num_experts) and the experts a token uses (get_num_experts_per_token)
    experts = _int(cfg, "num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts", default=0)
    if experts <= 1:
        return None
    per_token = _int(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_topk", default=2)
    # Mixtral's experts are intermediate_size wide; DeepSeek/Qwen-MoE name the expert width moe_intermediate_size.
    expert_width = _int(cfg, "moe_intermediate_size", default=intermediate)
    shared = 0
    if cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * expert_width
    elif cfg.get("shared_expert_intermediate_size"):
        shared = int(cfg["shared_expert_intermediate_size"])
    dense_first = _int(cfg, "first_k_dense_replace", default=0)
    mlp_only = cfg.get("mlp_only_layers") or []
    step = _int(cfg, "decoder_sparse_step", default=1)
    moe_layers = sum(
        1 for i in range(layers) if i >= dense_first and i not in mlp_only and (step <= 1 or (i + 1) % step == 0)
    )
    return MoeShape(experts, per_token, expert_width, shared, moe_layers)


def read_architecture(config: Mapping[str, Any]) -> Architecture:
    """The architecture of a config.json; UnknownArchitecture when its KV cache is not one the arithmetic knows."""
    top_type = str(config.get("model_type") or "")
    cfg = text_config(config)
    model_type = str(cfg.get("model_type") or top_type)
    _refuse_other_caches(config, model_type, top_type)
    cfg = {**_DEFAULTS.get(model_type, {}), **{k: v for k, v in cfg.items() if v is not None}}
    archs = config.get("architectures")
    architecture = str(archs[0]) if isinstance(archs, list) and archs else None

    heads = _int(cfg, "num_attention_heads", "n_head")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", default=heads)
    head_dim = _int(cfg, "head_dim", default=0) or hidden // heads  # vLLM: explicit head_dim, else hidden / heads
    intermediate = _int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    vocab = _int(cfg, "vocab_size")
    max_pos = cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("seq_length")

    mla = _mla_shape(cfg, model_type)
    groups = _kv_groups(cfg, model_type, layers, kv_heads, head_dim, mla)

    return Architecture(
        model_type=model_type,
        architecture=architecture,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=int(max_pos) if max_pos else None,
        dtype=_dtype(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        groups=groups,
        moe=_moe(cfg, layers, intermediate, model_type),
        mla=mla,
        quantization=_quantization(cfg),
        multimodal=any(isinstance(config.get(k), Mapping) for k in _TEXT_CONFIG_KEYS),
    )


def _refuse_other_caches(config: Mapping[str, Any], model_type: str, top_type: str) -> None:
    """UnknownArchitecture for a model whose cache is not a paged attention KV cache."""
    for t in (model_type, top_type):
        if t in _STATE_SPACE_MODEL_TYPES:
            raise UnknownArchitecture(f"{t!r} keeps state-space, linear-attention or indexer caches")
        if t in _ENCODER_DECODER_MODEL_TYPES or config.get("is_encoder_decoder"):
            raise UnknownArchitecture(f"{t!r} is an encoder-decoder model")


def _mla_shape(cfg: Mapping[str, Any], model_type: str) -> MlaShape | None:
    """The latent attention's shape (DeepSeek's MLA), None for a model without it."""
    if model_type not in MLA_MODEL_TYPES or cfg.get("kv_lora_rank") is None:
        return None
    return MlaShape(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", default=128),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", default=64),
        v_head_dim=_int(cfg, "v_head_dim", default=128),
    )


def _kv_groups(
    cfg: Mapping[str, Any], model_type: str, layers: int, kv_heads: int, head_dim: int, mla: MlaShape | None
) -> tuple[LayerGroup, ...]:
    """The layers by the KV cache they keep: latent (MLA), full attention, sliding window."""
    if mla is not None:
        # MLAAttentionSpec: num_kv_heads 1, head_size kv_lora_rank + qk_rope_head_dim, head_size_v 0; every layer.
        return (LayerGroup(layers, 1, mla.kv_lora_rank + mla.qk_rope_head_dim, 0, None, latent=True),)
    window = cfg.get("sliding_window")
    types = _layer_types(cfg, model_type, layers)
    sliding = types.count("sliding_attention")
    full = layers - sliding
    if sliding and not window:
        raise UnknownArchitecture("sliding-window layers without a sliding_window size")
    return tuple(
        g
        for g in (
            LayerGroup(full, kv_heads, head_dim, head_dim, None),
            LayerGroup(sliding, kv_heads, head_dim, head_dim, int(window) if window else None),
        )
        if g.layers > 0
    )


__all__ = [
    "MLA_MODEL_TYPES",
    "Architecture",
    "LayerGroup",
    "MlaShape",
    "MoeShape",
    "Quantization",
    "UnknownArchitecture",
    "read_architecture",
    "text_config",
]
