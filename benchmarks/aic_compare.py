"""The emulator's GPU step time against NVIDIA AIConfigurator's measured kernels.

AIConfigurator (PyPI `aiconfigurator`, NVIDIA's ai-dynamo project) holds kernel times measured per card and backend
version (GEMMs, attention, norms, communication) and adds them up into a forward pass; it runs on a CPU. For every
card and model that its vLLM database holds and this project's catalog holds too, this prints, beside AIC's figure:

- the decode step (batch 1..256 sequences of 512..8k tokens each) of `StepTimeModel.decode_step_seconds`, the model
  the twin (tuner/twin/simulate.py) and the emulator build for that GPU and model with vLLM's defaults, over AIC's
  `static_gen` single-step latency (`cli estimate --mode static_gen --osl 2`, one generation step);
- the prefill of one prompt of 512..8k tokens (`StepTimeModel.prefill_seconds`) over AIC's `static_ctx`;
- a closed loop (1024 in, 256 out, N clients): the emulator's virtual-time run (tuner.emulator.simulate) against
  AIC's `agg` estimate of TTFT and TPOT at that concurrency.

A ratio is ours / AIC's: above 1, the emulator's step is slower. A decode point whose batch x context does not fit
the KV cache vLLM would allocate on the card is marked * and left out of the summary (AIC times it anyway).

The project does not depend on AIConfigurator: it is installed in a separate virtual environment, with the
project beside it, and only this script imports it. From the repository's root:

    python3 -m venv /work/aic-venv
    /work/aic-venv/bin/pip install aiconfigurator==0.12.0 -e .
    PYTHONPATH=$PWD /work/aic-venv/bin/python benchmarks/aic_compare.py > aic.md     # a few minutes on a CPU

`--json benchmarks/data/aic_step_times.json` also writes AIC's figures, which the tests hold the emulator to.

Options: --cards h100_sxm,l40s (AIC's system names) to do fewer; --no-closed-loop to skip the slower agg estimates.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.capacity import plan_startup
from tuner.catalog import GpuProfile, ModelProfile, get_gpu, load_model
from tuner.emulator.simulate import simulate_closed_loop
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import ConfigError
from tuner.flags import VllmFlags, resolve

# AIC's system name -> this catalog's card (AIC's a100_sxm is the 80 GB part: mem_capacity 80 GiB in its yaml).
CARDS = {"h100_sxm": "h100-80gb", "h200_sxm": "h200", "a100_sxm": "a100-80gb", "b200_sxm": "b200", "l40s": "l40s"}
# AIC's model path -> this catalog's model, and the tensor parallelism it is compared at.
# Llama-3.1-8B-AWQ and Qwen2.5-7B are in ours only (AIC's vLLM data has no int4 AWQ GEMMs, its configs no Qwen2.5).
MODELS = {"meta-llama/Meta-Llama-3.1-8B": ("llama-3.1-8b", 1), "meta-llama/Meta-Llama-3.1-70B": ("llama-3.1-70b", 4)}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (512, 1024, 2048, 4096, 8192)
PROMPTS = (512, 1024, 2048, 4096, 8192)
CLOSED_LOOP = (1, 8, 32, 128)  # clients
LOOP_IN, LOOP_OUT = 1024, 256
MAX_MODEL_LEN = 16384  # room for 8k contexts; vLLM's KV pool does not depend on it


class Aic:
    """One AIC database and model, queried in process: the same calls its `cli estimate` makes, built once."""

    def __init__(self, system: str, model_path: str, tp: int) -> None:
        from aiconfigurator.sdk.backends.factory import get_backend
        from aiconfigurator.sdk.config_builders import build_model_config
        from aiconfigurator.sdk.models import get_model
        from aiconfigurator.sdk.perf_database import get_database_view, get_latest_database_version

        self.system, self.model_path, self.tp = system, model_path, tp
        self.version: str = get_latest_database_version(system=system, backend="vllm")
        self.database = get_database_view(system, "vllm", self.version, database_mode="SILICON")
        self.model = get_model(model_path, build_model_config(tp, 1, 1, tp, 1), "vllm")
        self.backend = get_backend("vllm")

    def _static(self, mode: str, batch: int, isl: int, osl: int) -> float:
        from aiconfigurator.sdk.config import RuntimeConfig

        config = RuntimeConfig(batch_size=batch, isl=isl, osl=osl, prefix=0, engine_step_backend="rust")
        ms: float = self.backend.run_static_latency_only(self.model, self.database, config, mode, stride=1)
        return ms / 1e3

    def decode_s(self, batch: int, context: int) -> float:
        return self._static("static_gen", batch, context, 2)  # osl 2: the one generation step after the prompt

    def prefill_s(self, tokens: int) -> float:
        return self._static("static_ctx", 1, tokens, 1)

    def closed_loop(self, clients: int) -> tuple[float, float]:
        """AIC's aggregated (in-flight batching) estimate: TTFT and TPOT in seconds."""
        from aiconfigurator.cli.api import cli_estimate

        r = cli_estimate(
            self.model_path,
            self.system,
            mode="agg",
            backend_name="vllm",
            backend_version=self.version,
            isl=LOOP_IN,
            osl=LOOP_OUT,
            batch_size=clients,
            tp_size=self.tp,
        )
        return float(r.ttft) / 1e3, float(r.tpot) / 1e3


@dataclass
class Pair:
    card: str
    model: str
    tp: int
    version: str
    decode: dict[tuple[int, int], tuple[float, float, bool]] = field(default_factory=dict)  # ours, aic, fits
    prefill: dict[int, tuple[float, float]] = field(default_factory=dict)
    loop: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)  # ttft ours/aic, tpot ours/aic

    def decode_ratios(self) -> list[float]:
        return [o / a for o, a, fits in self.decode.values() if fits]

    def prefill_ratios(self) -> list[float]:
        return [o / a for o, a in self.prefill.values()]


def _ours(model: ModelProfile, gpu: GpuProfile, flags: VllmFlags) -> tuple[StepTimeModel, int]:
    """The step-time model the twin builds for these flags on this card (no fitted profile), and its KV tokens."""
    resolved = resolve(flags, gpu, model)
    return StepTimeModel.build(model, gpu, resolved), plan_startup(model, gpu, resolved, 0.0).kv_tokens


def compare(system: str, model_path: str, closed_loop: bool) -> Pair:
    key, tp = MODELS[model_path]
    model, gpu = load_model(key), get_gpu(CARDS[system])
    aic = Aic(system, model_path, tp)
    flags = VllmFlags(max_model_len=MAX_MODEL_LEN, tensor_parallel_size=tp)  # vLLM's defaults otherwise
    ours, kv_tokens = _ours(model, gpu, flags)
    pair = Pair(gpu.key, key, tp, aic.version)
    for b in BATCHES:
        for c in CONTEXTS:
            pair.decode[b, c] = (ours.decode_step_seconds(b, c), aic.decode_s(b, c), b * (c + 1) <= kv_tokens)
    for n in PROMPTS:
        pair.prefill[n] = (ours.prefill_seconds(n), aic.prefill_s(n))
    for clients in CLOSED_LOOP if closed_loop else ():
        try:
            sim = simulate_closed_loop(model, gpu, flags, concurrency=clients, input_len=LOOP_IN, output_len=LOOP_OUT)
            ttft, tpot = aic.closed_loop(clients)
        except (ConfigError, RuntimeError) as e:  # a start that fails here, or AIC's out-of-memory verdict
            print(f"{gpu.key} + {key}, {clients} clients: skipped ({e})", file=sys.stderr)
            continue
        pair.loop[clients] = (sim.ttft_mean_s, ttft, sim.tpot_mean_s, tpot)
    return pair


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return [line(header), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|", *(line(r) for r in rows)]


def _ctx(c: int) -> str:
    return f"{c // 1024}k" if c >= 1024 else str(c)


def render_pair(p: Pair) -> list[str]:
    out = [f"### {p.card} + {p.model}, TP {p.tp} (AIC: vLLM {p.version})", ""]
    out.append("Decode step, ours / AIC (AIC's ms), by batch and context (*: over the KV cache):")
    out.append("")
    rows = []
    for b in BATCHES:
        cells = [str(b)]
        for c in CONTEXTS:
            o, a, fits = p.decode[b, c]
            cells.append(f"{o / a:.2f} {a * 1e3:5.1f}" + ("" if fits else "*"))
        rows.append(cells)
    out += _table(["batch", *(_ctx(c) for c in CONTEXTS)], rows)
    out += ["", "Prefill of one prompt:", ""]
    rows = [[_ctx(n), f"{a * 1e3:.1f}", f"{o * 1e3:.1f}", f"{o / a:.2f}"] for n, (o, a) in p.prefill.items()]
    out += _table(["tokens", "AIC ms", "ours ms", "ratio"], rows)
    if p.loop:
        out += ["", f"Closed loop, {LOOP_IN} in / {LOOP_OUT} out (mean TTFT and TPOT, ms):", ""]
        rows = []
        for n, (to, ta, po, pa) in p.loop.items():
            ttft = [f"{ta * 1e3:.1f}", f"{to * 1e3:.1f}", f"{to / ta:.2f}"]
            rows.append([str(n), *ttft, f"{pa * 1e3:.2f}", f"{po * 1e3:.2f}", f"{po / pa:.2f}"])
        out += _table(["clients", "AIC TTFT", "ours", "ratio", "AIC TPOT", "ours", "ratio"], rows)
    return [*out, ""]


def render_summary(pairs: Sequence[Pair]) -> list[str]:
    def span(xs: list[float]) -> list[str]:
        return [f"{statistics.median(xs):.2f}", f"{min(xs):.2f}-{max(xs):.2f}"] if xs else ["-", "-"]

    rows = [[p.card, p.model, *span(p.decode_ratios()), *span(p.prefill_ratios())] for p in pairs]
    header = ["card", "model", "decode", "range", "prefill", "range"]
    common = statistics.mode(p.version for p in pairs)
    others = sorted({f"{p.card}: {p.version}" for p in pairs if p.version != common})
    title = [
        "Summary: ours / AIC, median and range (decode: the points that fit the KV cache)",
        f"AIC's data is for vLLM {common}" + (f" ({', '.join(others)})." if others else "."),
    ]
    return [*title, "", *_table(header, rows), ""]


def reference(pairs: Sequence[Pair]) -> dict[str, Any]:
    """AIC's step times, for tests/emulator/test_gpu_step_time_sources.py to hold the emulator to without AIC."""
    return {
        "about": "AIConfigurator 0.12.0's vLLM step times (seconds), written by benchmarks/aic_compare.py --json",
        "pairs": [
            {
                "gpu": p.card,
                "model": p.model,
                "tp": p.tp,
                "aic_vllm": p.version,
                "decode": [[b, c, a] for (b, c), (_, a, fits) in p.decode.items() if fits],
                "prefill": [[n, a] for n, (_, a) in p.prefill.items()],
            }
            for p in pairs
        ],
    }


def main(argv: Sequence[str] | None = None, write: Callable[[str], Any] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cards", default=",".join(CARDS), help=f"AIC system names, of {', '.join(CARDS)}")
    parser.add_argument("--no-closed-loop", action="store_true", help="skip the agg (closed-loop) estimates")
    parser.add_argument("--json", metavar="PATH", help="also write AIC's step times there (the tests' reference)")
    args = parser.parse_args(argv)
    cards = [c.strip() for c in args.cards.split(",") if c.strip()]
    unknown = [c for c in cards if c not in CARDS]
    if unknown:
        print(f"--cards: unknown {', '.join(unknown)}; allowed: {', '.join(CARDS)}", file=sys.stderr)
        return 2
    try:
        import aiconfigurator  # noqa: F401
    except ImportError:
        print("aiconfigurator is not installed here: see the command at the top of this script", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # AIC logs every low-fidelity fallback table it loads
    pairs = [compare(card, path, not args.no_closed_loop) for card in cards for path in MODELS]
    if args.json:
        Path(args.json).write_text(json.dumps(reference(pairs), indent=1) + "\n")
    lines = render_summary(pairs)
    for p in pairs:
        lines += render_pair(p)
    write("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
