"""The emulator's command line: vLLM's flag names and defaults, plus the emulator's own flags.

One parser serves `python -m tuner.emulator` and `tuner emulate`. Bad values are a `ConfigError` (one line,
exit 2); vLLM flags the emulator does not model are accepted and reported in a WARNING line, as a newer vLLM
would be told an option it can safely ignore; an option the pinned vLLM does not have is refused as vLLM refuses it
(argparse's "unrecognized arguments", exit 2), and a model vLLM would look for on the hub and refuse as a name is
a `VllmRefusal` in vLLM's words (exit 1).
"""

from __future__ import annotations

import argparse
import os
import textwrap
from dataclasses import dataclass, field
from typing import NoReturn

from tuner.catalog import CPU, GPUS, GpuProfile, ModelProfile, get_gpu, load_model
from tuner.errors import CatalogError, ConfigError
from tuner.flags import BLOCK_SIZES, KV_CACHE_DTYPES, VllmFlags, parse_human_int, parse_model_len
from tuner.step_profile import StepProfile, load_profile
from tuner.vllm_args import vllm_args

EXAMPLE = (
    "example:\n"
    "  {prog} --model llama-3.1-8b --gpu rtx4090 \\\n"
    "    --max-model-len 8192 --port 8000\n"
    "  {prog} --model llama-3.1-8b --gpu rtx4090 \\\n"
    "    --max-model-len auto --gpu-memory-utilization 0.95\n"
    "  curl -N localhost:8000/v1/completions \\\n"
    "    -H 'Content-Type: application/json' \\\n"
    '    -d \'{{"model": "llama-3.1-8b", "prompt": "Hello",\n'
    '         "max_tokens": 32, "stream": true}}\'\n'
)
# The help reads whole in an 80-column terminal: the description is wrapped here, the example kept as written.
DESCRIPTION = textwrap.fill(
    "A CPU-only look-alike of vLLM's OpenAI-compatible server: vLLM's flags, start-up memory arithmetic, V1 "
    "scheduler, paged KV cache, latency shape, HTTP and /metrics surface.",
    width=78,
)


class VllmRefusal(ConfigError):
    """A command line vLLM parses and then refuses while it builds its config: its exit code is 1, not argparse's 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"emulator argument error: {message}")


def _model_len(text: str) -> int:
    try:
        return parse_model_len(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _human_int(text: str) -> int:
    try:
        return parse_human_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


# one piece: vLLM's flags and the emulator's own in one readable list, in the order `--help` shows them
def build_parser(prog: str = "python -m tuner.emulator") -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EXAMPLE.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    v = p.add_argument_group("vLLM flags (vLLM's names and defaults)")
    v.add_argument("--model", help="built-in profile (llama-3.1-8b, ...), its hub name, or a dir with config.json")
    v.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME", help="name(s) the API answers to")
    v.add_argument("--host", default="0.0.0.0")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--max-num-seqs", type=int, default=None)
    v.add_argument(
        "--max-model-len",
        type=_model_len,
        default=None,
        help="e.g. 8192, 8k (=8000), 8K (=8192); auto or -1: the longest the KV cache holds",
    )
    v.add_argument("--gpu-memory-utilization", type=float, default=None, help="default 0.9")
    v.add_argument("--max-num-batched-tokens", type=_human_int, default=None, help="e.g. 2048, 8k, 16K")
    v.add_argument(
        "--kv-cache-memory-bytes",
        type=_human_int,
        default=None,
        help="KV cache size outright, e.g. 4G (=4 x 2^30): no profiling, --gpu-memory-utilization ignored",
    )
    v.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    v.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    v.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=16)
    v.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    v.add_argument("--enforce-eager", action="store_true")
    v.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N runs (vLLM's default on a GPU; the CPU build never does)",
    )
    v.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, help="KV cache of N blocks, whatever the memory"
    )
    v.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    v.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    e = p.add_argument_group("emulator flags")
    e.add_argument("--gpu", default=None, help=f"GPU to imitate: {', '.join(GPUS)} (default h100-80gb)")
    e.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="cpu: imitate vLLM's CPU build (KV space from VLLM_CPU_KVCACHE_SPACE GiB, else the "
        "--gpu-memory-utilization share of this host's memory; 128 seqs, 2048 batched tokens, blocks of 128)",
    )
    e.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="step times from a device profile `tuner calibrate` wrote (instead of the GPU's roofline)",
    )
    e.add_argument("--gpu-memory-in-use-gib", type=_non_negative_float, default=0.0, help="held by other processes")
    e.add_argument("--time-scale", type=_positive_float, default=1.0, help="run S times faster than the GPU")
    e.add_argument("--seed", type=int, default=0, help="seed of the natural (EOS) output lengths and the step jitter")
    e.add_argument(
        "--step-jitter",
        type=_non_negative_float,
        default=None,
        metavar="SIGMA",
        help="spread of step times, the sigma of a log-normal factor of mean 1 (default 0.08, the least spread a "
        "real server showed; 0: every step takes the model's time), e.g. --step-jitter 0.2",
    )
    e.add_argument("--fault-hang-on-start", action="store_true", help="never become ready, never exit")
    e.add_argument(
        "--fault-crash-after-requests", type=int, default=None, metavar="N", help="die with a CUDA error after N"
    )
    return p


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything the command line decided, catalog entries resolved."""

    model_arg: str
    model: ModelProfile
    gpu: GpuProfile
    flags: VllmFlags
    served_model_names: tuple[str, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    memory_in_use_gib: float = 0.0
    time_scale: float = 1.0
    seed: int = 0
    step_jitter: float | None = None  # None: tuner.emulator.jitter.DEFAULT_STEP_JITTER
    disable_log_stats: bool = False
    api_key: str | None = None
    fault_hang_on_start: bool = False
    fault_crash_after_requests: int | None = None
    profile: StepProfile | None = None
    num_gpu_blocks_override: int | None = None
    ignored_args: tuple[str, ...] = ()
    non_default_args: dict[str, object] = field(default_factory=dict)

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


def _is_vllms(option: str) -> bool:
    """Whether the pinned vLLM has this `--option` (or `--no-option` of a switch)."""
    known = vllm_args()
    name = option[2:].split("=", 1)[0].replace("-", "_")
    negated = known.get(name.removeprefix("no_")) if name.startswith("no_") else None
    return name in known or (negated is not None and negated.kind == "switch")


def _split_unknown(extras: list[str]) -> list[str]:
    """Options the emulator's parser lacks, kept for a warning with their values when the pinned vLLM has them; a
    `--option` vLLM lacks is refused in argparse's words, as vLLM refuses it (the word after it is not named: vLLM's
    optional `model_tag` positional takes it); a stray word is an error."""
    ignored: list[str] = []
    unknown: list[str] = []
    for i, arg in enumerate(extras):
        value = i > 0 and extras[i - 1].startswith("--") and "=" not in extras[i - 1]
        if arg.startswith("--") and not _is_vllms(arg):
            unknown.append(arg)
        elif value and extras[i - 1] in unknown:
            continue
        elif arg.startswith("-") or value:
            ignored.append(arg)
        else:
            raise ConfigError(f"emulator argument error: unrecognized argument {arg!r}")
    if unknown:
        raise ConfigError(f"unrecognized arguments: {' '.join(unknown)}")
    return ignored


def _load_model(model_arg: str) -> ModelProfile:
    try:
        return load_model(model_arg)
    except CatalogError:
        if model_arg.count("/") > 1 and not os.path.isdir(model_arg):
            # vLLM takes what is not a directory for a hub id, which huggingface_hub's validate_repo_id refuses
            raise VllmRefusal(
                f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{model_arg}'. Use `repo_type` "
                "argument if needed."
            ) from None
        raise


def parse_config(argv: list[str], prog: str = "python -m tuner.emulator") -> EmulatorConfig:
    """Parse the command line into a config; raises ConfigError (one line) for anything not allowed."""
    argv = list(argv)
    positional_model = None
    if argv and not argv[0].startswith("-"):  # `vllm serve MODEL ...` form
        positional_model = argv.pop(0)
    parser = build_parser(prog)
    ns, extras = parser.parse_known_args(argv)
    ignored = _split_unknown(extras)
    model_arg = ns.model or positional_model
    if not model_arg:
        raise ConfigError(
            "emulator argument error: --model is required (built-in profiles: llama-3.1-8b, llama-3.1-8b-awq, "
            "llama-3.1-70b, qwen2.5-7b; or a directory with a config.json)"
        )
    model = _load_model(model_arg)
    gpu = _device(ns.device, ns.gpu)
    profile = load_profile(ns.profile) if ns.profile else None
    _check_ranges(ns)
    flags = _flags(ns)
    non_default = _non_default_args(parser, ns, positional_model)
    return EmulatorConfig(
        model_arg=model_arg,
        model=model,
        gpu=gpu,
        flags=flags,
        served_model_names=tuple(ns.served_model_name or [model_arg]),
        host=ns.host,
        port=ns.port,
        memory_in_use_gib=ns.gpu_memory_in_use_gib,
        time_scale=ns.time_scale,
        seed=ns.seed,
        step_jitter=ns.step_jitter,
        disable_log_stats=ns.disable_log_stats,
        api_key=ns.api_key,
        fault_hang_on_start=ns.fault_hang_on_start,
        fault_crash_after_requests=ns.fault_crash_after_requests,
        profile=profile,
        num_gpu_blocks_override=ns.num_gpu_blocks_override,
        ignored_args=tuple(ignored),
        non_default_args=non_default,
    )


def _check_ranges(ns: argparse.Namespace) -> None:
    """The limits argparse's types leave to check; ConfigError (one line) names the flag."""
    if not 0 < ns.port < 65536 and ns.port != 0:
        raise ConfigError(f"emulator argument error: --port must be in 0..65535, got {ns.port}")
    if ns.fault_crash_after_requests is not None and ns.fault_crash_after_requests < 0:
        raise ConfigError("emulator argument error: --fault-crash-after-requests must be >= 0")
    if ns.num_gpu_blocks_override is not None and ns.num_gpu_blocks_override < 1:
        raise ConfigError("emulator argument error: --num-gpu-blocks-override must be >= 1")
    if ns.tensor_parallel_size < 1:
        raise ConfigError("emulator argument error: --tensor-parallel-size must be >= 1")
    if ns.kv_cache_memory_bytes is not None and ns.kv_cache_memory_bytes < 1:
        raise ConfigError("emulator argument error: --kv-cache-memory-bytes must be >= 1 (bytes, e.g. 4G)")
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and ns.tensor_parallel_size > len(visible):
        # The GPUs it was given, as vLLM counts them (vllm/config/parallel.py, ParallelConfig's world-size check
        # against the node's visible devices); unset, the emulator imitates a box with enough.
        raise ConfigError(
            f"World size ({ns.tensor_parallel_size}) is larger than the number of available GPUs ({len(visible)}) in "
            "this node. If this is intentional and you are using:\n- ray, set '--distributed-executor-backend ray'.\n"
            "- multiprocessing, set '--nnodes' appropriately."
        )


def _flags(ns: argparse.Namespace) -> VllmFlags:
    # Every flag VllmFlags holds is an argument of the parser above under its own name (argparse's dest), so a flag
    # added to VllmFlags without its argument fails here, at the emulator's first start, not silently.
    return VllmFlags(**{name: getattr(ns, name) for name in VllmFlags.model_fields if name != "extra"})


def _non_default_args(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, positional_model: str | None
) -> dict[str, object]:
    """The options given other than at their default, as vLLM logs them at start-up."""
    defaults = vars(parser.parse_args([]))
    non_default = {k: v for k, v in vars(ns).items() if v != defaults.get(k)}
    if positional_model:
        non_default["model"] = positional_model
    return non_default


def _device(device: str, gpu: str | None) -> GpuProfile:
    """`--device cpu` is vLLM's CPU build on this host (`--gpu cpu` says the same); a GPU is named by --gpu."""
    if device == CPU:
        if gpu is not None and gpu.strip().lower() != CPU:
            raise ConfigError(f"emulator argument error: --device cpu imitates vLLM's CPU build; drop --gpu {gpu}")
        return get_gpu(CPU)
    return get_gpu(gpu or "h100-80gb")
