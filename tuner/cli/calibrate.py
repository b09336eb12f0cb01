"""`tuner calibrate`: fit a device profile (the step-time coefficients) to a short probe of a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tuner.calibration.build import engine_shape, fit_profile
from tuner.calibration.fit import LoadPoint, Measured
from tuner.calibration.probe import default_points, probe_points
from tuner.catalog import get_gpu, load_model
from tuner.cli import app
from tuner.cli.bench import target_url
from tuner.errors import ConfigError, TunerError
from tuner.flags import VllmFlags

__all__ = ["calibrate"]

console = Console(soft_wrap=True)  # a line per point and per figure, whatever the terminal


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ConfigError(f"{option} {text!r}: give whole numbers >= 1 separated by commas, e.g. 1,4,16")
    return values


def _points(concurrency: str, input_len: str, output_len: int, rounds: int) -> list[LoadPoint]:
    cs = _int_list(concurrency, "--concurrency")
    ns = _int_list(input_len, "--input-len")
    if output_len < 2:
        raise ConfigError(f"--output-len {output_len}: at least 2 tokens (TPOT needs two)")
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: at least 1")
    if len(cs) * len(ns) * 3 < 5 or len(cs) < 2 or len(ns) < 2:
        raise ConfigError(
            "the fit needs at least two concurrencies and two prompt lengths (five coefficients from TTFT, TPOT and "
            "throughput at each point), e.g. --concurrency 1,4,16 --input-len 128,512"
        )
    return default_points(cs, ns, output_len, rounds)


@app.command(
    "calibrate",
    help="Fit a device profile to a real vLLM server: a few closed-loop load points (each concurrency at each "
    "prompt length, tuner's own load client), then the step-time coefficients (per prompt token, per decoding "
    "sequence, per step, per context token, per request) that make the emulator's engine reproduce their TTFT, "
    "TPOT and throughput. The JSON file is what [bold]tuner emulate --profile[/bold] and a job's "
    "[bold]target.profile[/bold] read.\n\n"
    "Example: [bold]tuner calibrate --url http://127.0.0.1:8000 --device cpu -o cpu-profile.json[/bold]",
)
def calibrate(
    url: Annotated[str, typer.Option(help="the server's address (http://host:port)")],
    output: Annotated[Path, typer.Option("--output", "-o", help="the profile file to write (JSON)")],
    device: Annotated[
        str, typer.Option(help="what the server runs on: cpu (vLLM's CPU build) or a catalog GPU (h100-80gb, ...)")
    ] = "cpu",
    model: Annotated[str | None, typer.Option(help="the served model name (default: the server's only one)")] = None,
    model_config: Annotated[
        str | None,
        typer.Option(help="the model's config.json directory or hub id, when the server's `root` is not readable here"),
    ] = None,
    concurrency: Annotated[str, typer.Option(help="closed-loop concurrencies to probe")] = "1,4,16",
    input_len: Annotated[str, typer.Option(help="prompt lengths to probe (tokens)")] = "128,512",
    output_len: Annotated[int, typer.Option(help="output tokens of every probe request")] = 32,
    rounds: Annotated[int, typer.Option(help="measured requests per point, in rounds of its concurrency")] = 4,
    max_num_seqs: Annotated[int | None, typer.Option(help="the server's --max-num-seqs, if not vLLM's default")] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="the server's --max-num-batched-tokens, if not vLLM's default")
    ] = None,
) -> None:
    base = target_url(url)
    points = _points(concurrency, input_len, output_len, rounds)
    dev = get_gpu(device)

    def shown(p: LoadPoint, m: Measured) -> None:
        console.print(
            f"c={p.concurrency:<3} in={p.input_len:<5} out={p.output_len}: {m.output_tok_s:8.1f} tok/s, "
            f"TTFT {m.ttft_mean_s * 1e3:8.1f} ms, TPOT {m.tpot_mean_s * 1e3:6.2f} ms",
            highlight=False,
        )

    console.print(f"probing {base}: {len(points)} load points", highlight=False)
    facts, measured = asyncio.run(probe_points(base, model, points, shown))
    source = model_config or facts.root or facts.model
    try:
        model_profile = load_model(source)
    except TunerError as e:
        raise ConfigError(f"{e}; give --model-config (the model's directory or hub id)") from None
    flags = VllmFlags(
        max_model_len=facts.max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
    )
    shape = engine_shape(model_profile, dev, flags, facts.num_gpu_blocks)
    profile = fit_profile(
        shape, measured, served_model=facts.model, vllm_version=facts.vllm_version, source="probe", url=base
    )
    try:
        profile.write(output)
    except OSError as e:
        raise ConfigError(f"--output {output}: cannot write it ({e.strerror or e})") from None
    c = profile.coefficients
    console.print(
        f"step {c.step_overhead_s * 1e3:.3f} ms + prompt token {c.prefill_token_s * 1e6:.2f} us + decoding seq "
        f"{c.decode_seq_s * 1e6:.1f} us + context token {c.context_token_s * 1e9:.1f} ns; request latency "
        f"{c.request_latency_s * 1e3:.2f} ms",
        highlight=False,
    )
    console.print(
        f"fit: {profile.fitted_from.relative_rms_error:.1%} rms relative error over {len(points)} points x 3 figures "
        f"(vLLM {facts.vllm_version or 'version unknown'}); wrote {output}",
        highlight=False,
    )
