"""`tuner calibrate`: fit a device profile (the step-time coefficients) to a short probe of a real server, or to
the trials a study already measured."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from tuner.calibration.build import engine_shape, fit_profile, fit_study
from tuner.calibration.fit import LoadPoint, Measured, error_figures
from tuner.calibration.probe import decode_unseen, default_points, probe_points
from tuner.calibration.trials import read_trials
from tuner.catalog import ModelProfile, get_gpu, load_model
from tuner.cli import app, err_console
from tuner.cli.common import storage_url, target_url
from tuner.errors import ConfigError, TunerError
from tuner.flags import VllmFlags
from tuner.report.storage import job_study_name, opened_study, sole_study
from tuner.step_profile import StepProfile
from tuner.store import safe_url

__all__ = ["calibrate"]

console = Console(soft_wrap=True)  # a line per point and per figure, whatever the terminal

# What only a probe reads: a study's trials ran their own loads on their own flags.
_PROBE_ONLY = ("model", "concurrency", "input_len", "output_len", "rounds", "max_num_seqs", "max_num_batched_tokens")


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


# Not the study commands' --storage and --job: given, they choose the study source over a probe, so they read
# no environment variable.
StudyNameOpt = Annotated[
    str | None,
    typer.Option(
        help="fit the trials this study measured instead of probing (default with --storage or --job: the job "
        "file's study, else the storage's only one)",
        show_default=False,
    ),
]
StudyStorageOpt = Annotated[
    str | None,
    typer.Option(
        help="the study's storage URL (sqlite:///night.db, postgresql+psycopg://...); default: the --job file's, "
        "else $TUNER_STORAGE_URL, else sqlite:///tuner.db",
        show_default=False,
    ),
]
StudyJobOpt = Annotated[
    Path | None, typer.Option(help="a job file: its storage, and its study when --study is left out")
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        help="what the server runs on: cpu (vLLM's CPU build) or a catalog GPU (h100-80gb, ...); default: cpu "
        "for a probe, the GPU the study ran on for --study",
        show_default=False,
    ),
]
ProbeModelOpt = Annotated[
    str | None, typer.Option(help="probe: the served model name (default: the server's only one)")
]
ModelConfigOpt = Annotated[
    str | None,
    typer.Option(
        help="the model's config.json directory or hub id, when the server's `root` (a probe) or the study's "
        "target.model is not readable here"
    ),
]
MaxNumSeqsOpt = Annotated[int | None, typer.Option(help="probe: the server's --max-num-seqs, if not vLLM's default")]
MaxNumBatchedTokensOpt = Annotated[
    int | None, typer.Option(help="probe: the server's --max-num-batched-tokens, if not vLLM's default")
]


@app.command(
    "calibrate",
    help="Fit a device profile, the step-time coefficients (per step, per prompt token, per decoding sequence, per "
    "context token, per request) that make the emulator's engine reproduce a real vLLM server's TTFT, TPOT and "
    "throughput. The JSON file is what [bold]tuner emulate --profile[/bold] and a job's "
    "[bold]target.profile[/bold] read.\n\n"
    "Two sources: [bold]--url[/bold] probes a running server (a few closed-loop load points, each concurrency at "
    "each prompt length, tuner's own load client); [bold]--study[/bold] (or [bold]--storage[/bold] / "
    "[bold]--job[/bold]) fits the trials a study already measured in full, each replayed on its own flags, "
    "starting no server: a GPU box's overnight study makes that GPU's profile.\n\n"
    "Examples:\n\n"
    "[bold]tuner calibrate --url http://127.0.0.1:8000 --device cpu -o cpu-profile.json[/bold]\n\n"
    "[bold]tuner calibrate --study night --storage sqlite:///night.db -o h100-profile.json[/bold]",
)
def calibrate(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("--output", "-o", help="the profile file to write (JSON)")],
    url: Annotated[str | None, typer.Option(help="the server to probe (http://host:port)", show_default=False)] = None,
    study: StudyNameOpt = None,
    storage: StudyStorageOpt = None,
    job: StudyJobOpt = None,
    device: DeviceOpt = None,
    model: ProbeModelOpt = None,
    model_config: ModelConfigOpt = None,
    concurrency: Annotated[str, typer.Option(help="probe: closed-loop concurrencies")] = "1,4,16",
    input_len: Annotated[str, typer.Option(help="probe: prompt lengths (tokens)")] = "128,512",
    output_len: Annotated[int, typer.Option(help="probe: output tokens of every request")] = 32,
    rounds: Annotated[int, typer.Option(help="probe: measured requests per point, in rounds of its concurrency")] = 4,
    max_num_seqs: MaxNumSeqsOpt = None,
    max_num_batched_tokens: MaxNumBatchedTokensOpt = None,
) -> None:
    from_study = study is not None or storage is not None or job is not None
    if from_study and url is not None:
        raise ConfigError("--url probes a server, --study/--storage/--job fit a study's trials: give one of the two")
    if not from_study and url is None:
        raise ConfigError(
            "give --url (probe a running server) or --study/--storage/--job (fit the trials a study measured)"
        )
    config = _model_config(model_config)
    if from_study:
        given = [name for name in _PROBE_ONLY if _given(ctx, name)]
        if given:
            option = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{option} is for a probe (--url): a study's trials ran their own loads and flags")
        _from_study(output, study, storage, job, device, config)
        return
    assert url is not None
    flags = VllmFlags(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    points = _points(concurrency, input_len, output_len, rounds)
    _from_probe(output, url, device or "cpu", model, config, flags, points)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the command line gave the option (typer's own click: its ParameterSource is not public)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _model_config(source: str | None) -> ModelProfile | None:
    if source is None:
        return None
    try:
        return load_model(source)
    except TunerError as e:
        raise ConfigError(f"--model-config {source!r}: {e}") from None


def _from_probe(
    output: Path,
    url: str,
    device: str,
    model: str | None,
    config: ModelProfile | None,
    flags: VllmFlags,
    points: list[LoadPoint],
) -> None:
    base = target_url(url)
    dev = get_gpu(device)

    def shown(p: LoadPoint, m: Measured) -> None:
        console.print(
            f"c={p.concurrency:<3} in={p.input_len:<5} out={p.output_len}: {m.output_tok_s:8.1f} tok/s, "
            f"TTFT {m.ttft_mean_s * 1e3:8.1f} ms, TPOT {m.tpot_mean_s * 1e3:6.2f} ms",
            highlight=False,
        )

    console.print(f"probing {base}: {len(points)} load points", highlight=False)
    facts, measured = asyncio.run(probe_points(base, model, points, shown))
    if config is None:
        try:
            config = load_model(facts.root or facts.model)
        except TunerError as e:
            raise ConfigError(f"{e}; give --model-config (the model's directory or hub id)") from None
    served = flags.model_copy(update={"max_model_len": facts.max_model_len})
    shape = engine_shape(config, dev, served, facts.num_gpu_blocks)
    profile = fit_profile(
        shape, measured, served_model=facts.model, vllm_version=facts.vllm_version, source="probe", url=base
    )
    _write(profile, output)
    means = [m for _, m in measured]
    console.print(
        f"fit: {profile.fitted_from.relative_rms_error:.1%} rms relative error over "
        f"{error_figures(means)} figures at {len(points)} points "
        f"(vLLM {facts.vllm_version or 'version unknown'}); wrote {output}",
        highlight=False,
    )
    if (warning := decode_unseen(means)) is not None:
        err_console.print(warning, highlight=False)  # warnings go to stderr, as every command's do


def _from_study(
    output: Path,
    study: str | None,
    storage: str | None,
    job: Path | None,
    device: str | None,
    config: ModelProfile | None,
) -> None:
    url = storage_url(storage, job)
    name = study or (job_study_name(job) if job is not None else sole_study(url))
    with opened_study(url, name) as opened:
        trials = read_trials(opened, url, device=get_gpu(device) if device else None, model=config)
    trials.require()
    console.print(
        f"study {name!r} in {safe_url(url)}: {trials.summary()}; replaying their loads in the engine",
        highlight=False,
    )
    with console.status("replaying") as status:
        profile = fit_study(trials, lambda n, e: status.update(f"replay {n}: best {e:.1%} rms error a request"))
    varied = sorted({k for p in profile.fitted_from.points for k in p.flags if _varies(profile, k)})
    for p in profile.fitted_from.points:
        flags = " ".join(f"{k}={p.flags[k]}" for k in varied if k in p.flags) or "vLLM's defaults"
        console.print(
            f"trial {p.trial}: {flags}: {p.measured_output_tok_s:.1f} tok/s (fit {p.predicted_output_tok_s:.1f}), "
            f"TTFT {p.measured_ttft_mean_s * 1e3:.1f} ms (fit {p.predicted_ttft_mean_s * 1e3:.1f}), "
            f"TPOT {p.measured_tpot_mean_s * 1e3:.2f} ms (fit {p.predicted_tpot_mean_s * 1e3:.2f})",
            highlight=False,
        )
    _write(profile, output)
    console.print(
        f"fit: {profile.fitted_from.relative_rms_error:.1%} rms relative error over "
        f"{error_figures([t.measured for t in trials.used])} figures from {len(trials.used)} trials "
        f"(vLLM {profile.vllm_version or 'version unknown'}, {trials.device.key}); wrote {output}",
        highlight=False,
    )


def _varies(profile: StepProfile, key: str) -> bool:
    return len({repr(p.flags.get(key)) for p in profile.fitted_from.points}) > 1


def _write(profile: StepProfile, output: Path) -> None:
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
