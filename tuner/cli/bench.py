"""`tuner bench`: one load test (or a search for the highest rate meeting SLOs) against a server or the emulator."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tuner import __version__
from tuner.cli import app
from tuner.cli.common import target_url
from tuner.clock import Clock
from tuner.errors import ConfigError, TunerError
from tuner.load import (
    Arrival,
    CapacitySearchResult,
    CapacityStep,
    LoadProgress,
    LoadResult,
    UniformLength,
    Workload,
    find_max_rate,
    run_load,
)
from tuner.load.prompt_fit import PromptFit, fit_prompts
from tuner.load.runner import new_client
from tuner.scoring import STATS, LoadSummary, Percentiles, Slo, headline_figures, latency_metrics, parse_slo

__all__ = ["BenchOptions", "bench", "bench_plan", "parse_length"]

console = Console()
err_console = Console(stderr=True)

_LEN_RE = re.compile(r"^\s*(\d+)\s*(?:[-:]\s*(\d+))?\s*$")


def parse_length(text: str, option: str) -> int | UniformLength:
    """`512` (fixed) or `100-500` (uniform between the two, inclusive)."""
    m = _LEN_RE.match(text)
    if not m or int(m.group(1)) < 1:
        raise ConfigError(f"{option} {text!r}: give a token count like 512, or a uniform range like 100-500")
    low = int(m.group(1))
    if m.group(2) is None:
        return low
    high = int(m.group(2))
    if high < low:
        raise ConfigError(f"{option} {text!r}: the range's upper end must be >= its lower end")
    return UniformLength(low=low, high=high)


async def _served_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        response = await client.get(base_url + "/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise TunerError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    try:
        ids = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        ids = []
    if response.status_code != 200 or not ids:
        raise ConfigError(f"{base_url}/v1/models did not name a model (HTTP {response.status_code}); pass --model")
    return str(ids[0])


@contextlib.asynccontextmanager
async def _target(url: str | None, emulator_args: list[str]) -> AsyncIterator[tuple[str, int | None, str]]:
    """Yields (base_url, max_num_seqs if known, description)."""
    if url is not None:
        yield target_url(url), None, target_url(url)
        return
    from tuner.emulator import Emulator

    emu = Emulator.from_args(emulator_args, log_stream=io.StringIO())
    async with emu.serve_http(host="127.0.0.1", port=0) as base:
        r = emu.resolved
        desc = (
            f"in-process emulator ({' '.join(emulator_args)}; KV {emu.plan.kv_tokens:,} tokens, "
            f"max_num_seqs {r.max_num_seqs})"
        )
        yield base, r.max_num_seqs, desc


class _ProgressLine:
    """The live line: done / in flight / errors / current req/s."""

    def __init__(self, total: int | None, label: str) -> None:
        self.total = total
        self.label = label
        self.latest: LoadProgress | None = None

    def update(self, p: LoadProgress) -> None:
        self.latest = p

    def __rich__(self) -> Text:
        p = self.latest
        if p is None:
            return Text(f"{self.label}: starting…", style="dim")
        done = f"{p.done}/{self.total}" if self.total else str(p.done)
        phase = " (warm-up)" if p.warmup else ""
        errors = Text(f"{p.failed} errors", style="red" if p.failed else "green")
        return Text.assemble(
            f"{self.label}{phase}: done {done} · in flight {p.in_flight} · ", errors,
            f" · {p.rate:.1f} req/s · {p.elapsed_s:.1f}s",
        )  # fmt: skip


# `tuner bench`'s options: one alias each, named for its parameter (Typer names an option without a flag name
# after the parameter: `input_len` is --input-len).
UrlOpt = Annotated[
    str | None,
    typer.Option(help="Server root or OpenAI base URL, e.g. http://localhost:8000. Default: start the emulator."),
]
ModelOpt = Annotated[str | None, typer.Option(help="Served model name. Default: the first of the server's /v1/models.")]
ConcurrencyOpt = Annotated[
    int | None,
    typer.Option(help="Closed loop: this many users, each sending when its last reply ends (default 16)."),
]
RateOpt = Annotated[float | None, typer.Option(help="Open loop: requests per second.")]
RequestsOpt = Annotated[int | None, typer.Option(help="Measured requests (default 200 unless --duration).")]
DurationOpt = Annotated[float | None, typer.Option(help="Measured seconds (emulated seconds on an emulator).")]
WarmupOpt = Annotated[int, typer.Option(help="Warm-up requests sent first and left out of the figures.")]
InputLenOpt = Annotated[
    str,
    typer.Option(
        help="Prompt tokens as the server counts them (chat: its template included): 512, or a range 100-500."
    ),
]
OutputLenOpt = Annotated[str, typer.Option(help="Output tokens (max_tokens + ignore_eos): 512 or 64-256.")]
DatasetOpt = Annotated[
    Path | None, typer.Option(help="JSONL of {'prompt', 'output_len'} or a ShareGPT JSON file (text prompts).")
]
ApiOpt = Annotated[
    str,
    typer.Option(
        help="completions (token-id prompts) or chat (text messages). Either way the prompts are written "
        "to the server's tokenizer (its /tokenize), so their lengths are exact; without /tokenize they are not "
        "checked, and the run says so."
    ),
]
PrefixLenOpt = Annotated[int, typer.Option(help="Prompt tokens shared by every request (prefix caching).")]
SeedOpt = Annotated[int, typer.Option(help="Seed of prompts, lengths and arrivals.")]
ProcessOpt = Annotated[str, typer.Option(help="Open-loop arrivals: poisson or constant.")]
BurstinessOpt = Annotated[float, typer.Option(help="Gamma shape of arrival gaps: 1 Poisson, <1 burstier.")]
MaxInFlightOpt = Annotated[int | None, typer.Option(help="Open loop: cap on requests in flight.")]
SloOpt = Annotated[
    list[str] | None,
    typer.Option(help="An SLO, repeatable: 'e2e_p95<=5s', 'ttft_p95<=500ms', 'success_rate>=0.99'."),
]
FindMaxRateOpt = Annotated[
    bool, typer.Option("--find-max-rate", help="Search the highest request rate that meets every --slo.")
]
MaxStepsOpt = Annotated[int, typer.Option(help="--find-max-rate: most open-loop steps after the probe.")]
StopEarlyOpt = Annotated[
    bool,
    typer.Option(
        "--stop-early",
        help="End the run once an --slo is missed for certain, e.g. at the 2nd failure of 100 requests under "
        "success_rate>=0.99 (needs --requests).",
    ),
]
TimeoutOpt = Annotated[float, typer.Option(help="Per-request timeout in (emulated) seconds.")]
TimeScaleOpt = Annotated[
    float | None,
    typer.Option(
        help="The emulator's --time-scale, so figures read as on the real GPU (default: 1 with --url, "
        "10 for the built-in emulator)."
    ),
]
JsonOutOpt = Annotated[Path | None, typer.Option("--json", help="Write the full result (every request) here.")]
ServerMetricsOpt = Annotated[
    bool,
    typer.Option(
        help="Scrape the server's /metrics during the run (once a second) to name the bottleneck; only the "
        "families read are asked for, about 1.5 ms of vLLM's API-process CPU a scrape. Turn it off to measure a "
        "CPU-starved server untouched (a single run: --find-max-rate always scrapes)."
    ),
]
GpuOpt = Annotated[str, typer.Option(help="Emulator only: GPU profile.")]
ModelProfileOpt = Annotated[str, typer.Option(help="Emulator only: model profile or config.json dir.")]
MaxModelLenOpt = Annotated[str, typer.Option(help="Emulator only: --max-model-len.")]
EmulatorArgOpt = Annotated[
    list[str] | None,
    typer.Option(help="Emulator only: one more vLLM flag, repeatable, e.g. --emulator-arg=--max-num-seqs=64."),
]


@app.command(
    "bench",
    help="Load-test an OpenAI-compatible server (or the built-in emulator) the way vLLM users measure it: "
    "streamed requests, TTFT/TPOT/ITL/e2e percentiles, tokens/s, failures by class, the server's /metrics.\n\n"
    "Example: [bold]tuner bench --url http://localhost:8000 --concurrency 16 --requests 200 "
    "--input-len 512 --output-len 512[/bold]\n\n"
    "Without --url it starts the emulator: [bold]tuner bench --gpu rtx4090 --max-model-len 8192 --rate 4 "
    "--slo 'e2e_p95<=20s' --find-max-rate[/bold]\n\n"
    "A reply shorter than the pinned output (vLLM shortens it to fit max_model_len) fails as short_output. "
    "Exit 1 when no request succeeded.",
)
def bench(
    url: UrlOpt = None,
    model: ModelOpt = None,
    concurrency: ConcurrencyOpt = None,
    rate: RateOpt = None,
    requests: RequestsOpt = None,
    duration: DurationOpt = None,
    warmup: WarmupOpt = 0,
    input_len: InputLenOpt = "512",
    output_len: OutputLenOpt = "128",
    dataset: DatasetOpt = None,
    api: ApiOpt = "completions",
    prefix_len: PrefixLenOpt = 0,
    seed: SeedOpt = 0,
    process: ProcessOpt = "poisson",
    burstiness: BurstinessOpt = 1.0,
    max_in_flight: MaxInFlightOpt = None,
    slo: SloOpt = None,
    find_max_rate_: FindMaxRateOpt = False,
    max_steps: MaxStepsOpt = 6,
    stop_early: StopEarlyOpt = False,
    timeout: TimeoutOpt = 60.0,
    time_scale: TimeScaleOpt = None,
    json_out: JsonOutOpt = None,
    server_metrics: ServerMetricsOpt = True,
    gpu: GpuOpt = "h100-80gb",
    model_profile: ModelProfileOpt = "llama-3.1-8b",
    max_model_len: MaxModelLenOpt = "8192",
    emulator_arg: EmulatorArgOpt = None,
) -> None:
    plan = bench_plan(BenchOptions(**locals()))
    try:
        asyncio.run(_bench(plan))
    except (KeyboardInterrupt, asyncio.CancelledError):
        err_console.print("interrupted")
        raise typer.Exit(130) from None


@dataclass(frozen=True)
class BenchOptions:
    """`tuner bench`'s command line, as given (None: left to the default the run picks)."""

    url: str | None = None
    model: str | None = None
    concurrency: int | None = None
    rate: float | None = None
    requests: int | None = None
    duration: float | None = None
    warmup: int = 0
    input_len: str = "512"
    output_len: str = "128"
    dataset: Path | None = None
    api: str = "completions"
    prefix_len: int = 0
    seed: int = 0
    process: str = "poisson"
    burstiness: float = 1.0
    max_in_flight: int | None = None
    slo: list[str] | None = None
    find_max_rate_: bool = False
    max_steps: int = 6
    stop_early: bool = False
    timeout: float = 60.0
    time_scale: float | None = None
    json_out: Path | None = None
    server_metrics: bool = True
    gpu: str = "h100-80gb"
    model_profile: str = "llama-3.1-8b"
    max_model_len: str = "8192"
    emulator_arg: list[str] | None = None


def bench_plan(o: BenchOptions) -> _Plan:
    """The run the options describe, every option checked first: a bad one is one line, before any load."""
    if o.concurrency is not None and o.rate is not None:
        raise ConfigError("give --concurrency (closed loop) or --rate (open loop), not both")
    if o.api not in ("completions", "chat"):
        raise ConfigError(f"--api {o.api!r}: allowed are completions, chat")
    if o.process not in ("poisson", "constant"):
        raise ConfigError(f"--process {o.process!r}: allowed are poisson, constant")
    if o.url is not None and o.emulator_arg:
        raise ConfigError("--emulator-arg applies only without --url (the built-in emulator)")
    slos = [parse_slo(s) for s in o.slo or []]
    if o.find_max_rate_ and not slos:
        raise ConfigError("--find-max-rate needs at least one --slo, e.g. --slo 'e2e_p95<=5s'")
    concurrency = 16 if o.concurrency is None and o.rate is None else o.concurrency
    requests = 200 if o.requests is None and o.duration is None else o.requests
    scale = o.time_scale if o.time_scale is not None else (1.0 if o.url is not None else 10.0)
    try:
        workload = Workload(
            input_len=parse_length(o.input_len, "--input-len"),
            output_len=parse_length(o.output_len, "--output-len"),
            dataset=o.dataset,
            api="chat" if o.api == "chat" else "completions",
            prefix_len=o.prefix_len,
            seed=o.seed,
        )
        arrival = Arrival(
            concurrency=concurrency,
            rate=o.rate,
            process="constant" if o.process == "constant" else "poisson",
            burstiness=o.burstiness,
            max_in_flight=o.max_in_flight,
            requests=requests,
            duration_s=o.duration,
            warmup_requests=o.warmup,
            seed=o.seed,
        )
        clock = Clock(scale)
    except ValueError as e:
        raise ConfigError(_validation_message(e)) from None
    workload.max_request_tokens()  # reads the dataset now: a bad file is a command-line error, before any load
    emulator_args = [
        "--model", o.model_profile, "--gpu", o.gpu, "--max-model-len", o.max_model_len, "--time-scale", f"{scale:g}",
        *(o.emulator_arg or []),
    ]  # fmt: skip
    if o.url is None and o.model is not None:
        emulator_args += ["--served-model-name", o.model]
    return _Plan(
        o.url, o.model, workload, arrival, slos, clock, o.timeout, o.find_max_rate_, o.max_steps, o.json_out,
        emulator_args, stop_early=o.stop_early, server_metrics=o.server_metrics,
    )  # fmt: skip


def _validation_message(e: ValueError) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            where = ".".join(str(x) for x in err.get("loc", ())) or "value"
            parts.append(f"{where}: {err.get('msg')}")
        return "; ".join(parts)
    return str(e)


class _Interrupt:
    """The first Ctrl-C stops sending and reports what was measured; a second one abandons the run."""

    def __init__(self) -> None:
        self.requested = False
        self._task: asyncio.Task[Any] | None = None

    def __call__(self) -> bool:
        return self.requested

    def _on_sigint(self) -> None:
        if self.requested and self._task is not None:
            self._task.cancel()
            return
        self.requested = True
        err_console.print("stopping: in-flight requests are abandoned, the figures so far follow (Ctrl-C again quits)")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        try:
            loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            yield
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGINT)


@dataclass(frozen=True)
class _Plan:
    """What one `tuner bench` run measures, as the command line said it."""

    url: str | None
    model: str | None
    workload: Workload
    arrival: Arrival
    slos: list[Slo]
    clock: Clock
    timeout: float
    search: bool
    max_steps: int
    json_out: Path | None
    emulator_args: list[str]
    stop_early: bool = False
    server_metrics: bool = True


async def _bench(plan: _Plan) -> None:
    interrupted = _Interrupt()
    with interrupted.installed():
        async with _target(plan.url, plan.emulator_args) as (base, max_num_seqs, desc), new_client() as client:
            served = plan.model if plan.model is not None else await _served_model(client, base)
            console.print(f"[bold]target[/bold] {escape(desc)} · model [bold]{escape(served)}[/bold]", highlight=False)
            fit: PromptFit | None = None
            if plan.workload.dataset is None or plan.workload.prefix_len:
                fit = await fit_prompts(client, base, served)
                console.print(f"[bold]prompts[/bold] {escape(fit.note)}", highlight=False)
            total = (plan.arrival.requests or 0) + plan.arrival.warmup_requests if plan.arrival.requests else None
            line = _ProgressLine(total, plan.arrival.describe())
            payload: dict[str, Any] = {
                "tuner_version": __version__,
                "target": base,
                "model": served,
                "time_scale": plan.clock.scale,
                "workload": plan.workload.model_dump(mode="json"),
                "workload_fingerprint": plan.workload.fingerprint(),
                "arrival": plan.arrival.model_dump(mode="json"),
                "slos": [str(s) for s in plan.slos],
                "prompt_fit": _fit_json(fit),
            }
            if plan.search:
                steps_view = _StepsView(line)
                with Live(steps_view, console=err_console, refresh_per_second=8, transient=True):
                    found = await find_max_rate(
                        base, served, plan.workload, plan.slos, client=client, clock=plan.clock,
                        requests_per_step=plan.arrival.requests or 100, max_steps=plan.max_steps,
                        request_timeout_s=plan.timeout,
                        process=plan.arrival.process, seed=plan.arrival.seed, max_num_seqs=max_num_seqs,
                        on_step=steps_view.add, on_progress=line.update, should_stop=interrupted,
                        stop_on_slo_miss=plan.stop_early,
                    )  # fmt: skip
                summaries = [s.summary for s in found.steps] + ([found.probe] if found.probe else [])
                _unreachable_check(base, summaries)
                render_search(found, plan.slos, console)
                payload["capacity_search"] = found.model_dump(mode="json")
            else:
                with Live(line, console=err_console, refresh_per_second=8, transient=True):
                    result = await run_load(
                        base, served, plan.workload, plan.arrival, slos=plan.slos, client=client, clock=plan.clock,
                        request_timeout_s=plan.timeout, on_progress=line.update, max_num_seqs=max_num_seqs,
                        should_stop=interrupted, stop_on_slo_miss=plan.stop_early, prompt_fit=fit,
                        scrape_metrics=plan.server_metrics,
                    )  # fmt: skip
                summaries = [result.summary]
                _unreachable_check(base, summaries)
                render_result(result, plan.slos, console)
                payload["result"] = result.model_dump(mode="json")
        if plan.json_out is not None:
            try:
                plan.json_out.write_text(json.dumps(payload, indent=1) + "\n")
            except OSError as e:
                raise ConfigError(f"--json {plan.json_out}: cannot write it ({e.strerror})") from None
            console.print(f"wrote {escape(str(plan.json_out))}", highlight=False)
    _all_failed_check(summaries)


def _unreachable_check(base: str, summaries: list[LoadSummary]) -> None:
    """Every request refused: nothing was measured, and there is nothing to show either."""
    sent = sum(s.requests_sent for s in summaries)
    refused = sum(s.failures.get("connection_refused", 0) for s in summaries)
    if sent and refused == sent:
        example = next(s.failure_examples["connection_refused"] for s in summaries if s.requests_sent)
        detail = example.split(": ", 1)[-1]  # the example starts with the URL, already named here
        raise TunerError(f"cannot reach {base}: all {sent} requests refused ({detail})")


def _fit_json(fit: PromptFit | None) -> dict[str, Any] | None:
    return None if fit is None else {"exact": fit.exact, "chat_overhead": fit.chat_overhead, "note": fit.note}


def _all_failed_check(summaries: list[LoadSummary]) -> None:
    """Not one request succeeded: the figures above measure nothing, so the command fails (after showing them)."""
    sent = sum(s.requests_sent for s in summaries)
    if not sent or any(s.requests_succeeded for s in summaries):
        return
    counts: dict[str, int] = {}
    for s in summaries:
        for cls, n in s.failures.items():
            counts[cls] = counts.get(cls, 0) + n
    cls = max(counts, key=lambda c: counts[c]) if counts else "unknown"
    example = next((s.failure_examples[cls] for s in summaries if cls in s.failure_examples), "")
    raise TunerError(f"all {sent} requests failed ({counts.get(cls, 0)} {cls}): {example}")


class _StepsView:
    def __init__(self, line: _ProgressLine) -> None:
        self.line = line
        self.steps: list[CapacityStep] = []

    def add(self, step: CapacityStep) -> None:
        self.steps.append(step)
        mark = "[green]meets[/green]" if step.meets_slos else "[red]misses[/red]"
        err_console.print(
            f"step {len(self.steps)}: {step.rate:.2f} req/s → {step.summary.request_throughput:.2f} req/s, "
            f"e2e p95 {_ms(step.summary.e2e.p95)}, {mark} the SLOs",
            highlight=False,
        )

    def __rich__(self) -> Group:
        return Group(self.line)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _summary_table(s: LoadSummary) -> Table:
    t = Table(title="Load summary", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows: list[tuple[str, str]] = [
        ("requests sent / succeeded / failed", f"{s.requests_sent} / {s.requests_succeeded} / {s.requests_failed}"),
        ("success rate", f"{s.success_rate:.1%}"),
        ("measured duration", f"{s.duration_s:,.2f} s"),
        ("request throughput", f"{s.request_throughput:,.2f} req/s"),
        ("output throughput", f"{s.output_throughput:,.1f} tok/s"),
        ("total throughput", f"{s.total_throughput:,.1f} tok/s"),
        ("goodput", f"{s.goodput:,.2f} req/s"),
        ("mean concurrency", f"{s.concurrency:,.1f}"),
        ("token counts from", "server usage" if s.usage_from_server else "[yellow]counted chunks (no usage)[/yellow]"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def _latency_table(s: LoadSummary) -> Table:
    t = Table(title="Latency (ms)", title_justify="left")
    t.add_column("metric", style="bold")
    for name in STATS:
        t.add_column(name, justify="right")
    labels: list[tuple[str, Percentiles]] = [(m.label.upper(), getattr(s, m.name)) for m in latency_metrics()]
    for label, p in labels:
        t.add_row(
            label,
            *(f"{p.stat(n) * 1000:,.1f}" if p.count else "–" for n in STATS),
        )
    return t


def _failures_table(s: LoadSummary) -> Table:
    t = Table(title="Failures", title_justify="left")
    t.add_column("class", style="bold red")
    t.add_column("count", justify="right")
    t.add_column("example")
    for cls, n in s.failures.items():
        t.add_row(cls, str(n), escape(s.failure_examples.get(cls, "")))
    return t


def _slo_lines(s: LoadSummary, slos: list[Slo]) -> list[str]:
    out = []
    for slo in slos:
        value = slo.value(s)
        shown = _ms(value) if slo.is_latency else f"{value:.4g}"
        verdict = "[green]met[/green]" if slo.met(s) else "[red]missed[/red]"
        out.append(f"SLO {escape(str(slo))}: {shown} — {verdict}")
    return out


def render_result(result: LoadResult, slos: list[Slo], out: Console) -> None:
    s = result.summary
    out.print(
        f"[bold]{escape(result.mode)}[/bold]" + (" [yellow](stopped early)[/yellow]" if result.stopped_early else "")
    )
    if result.slo_stop:
        out.print(f"[yellow]stopped early:[/yellow] {escape(result.slo_stop)}")
    out.print(_summary_table(s))
    out.print(_latency_table(s))
    if s.failures:
        out.print(_failures_table(s))
    if result.server is not None:
        sv = result.server
        if sv.samples:
            out.print(
                f"[bold]server[/bold] KV cache {_pct(sv.kv_usage_max)} max / {_pct(sv.kv_usage_mean)} mean · "
                f"running {_num(sv.running_max)} max · waiting {_num(sv.waiting_max)} max · "
                f"preemptions {_num(sv.preemptions)} · {sv.samples} scrapes",
                highlight=False,
            )
        if sv.error:
            out.print(f"[bold]server metrics[/bold] {escape(sv.error)}", highlight=False)
    for line in _slo_lines(s, slos):
        out.print(line, highlight=False)
    out.print(f"[bold]diagnosis[/bold] {escape(result.diagnosis)}", highlight=False)


def render_search(found: CapacitySearchResult, slos: list[Slo], out: Console) -> None:
    if found.probe is not None and found.estimate_rate is not None:
        out.print(f"probe (closed loop): {found.estimate_rate:.2f} req/s saturated throughput", highlight=False)
    t = Table(title="Capacity search", title_justify="left")
    # the figures the SLOs name (a `ttft_p90` SLO's TTFT P90), then the registry's headline ones
    shown = headline_figures(slo.metric for slo in slos)
    for col in ("step", "offered req/s", "req/s", "output tok/s", *(f.label for f in shown), "success", "SLOs"):
        t.add_column(col, justify="right")
    for i, step in enumerate(found.steps, 1):
        s = step.summary
        t.add_row(
            str(i), f"{step.rate:.2f}", f"{s.request_throughput:.2f}", f"{s.output_throughput:,.0f}",
            *(_ms(v) if (v := f.of(s)) is not None else "–" for f in shown), f"{s.success_rate:.1%}",
            "[green]met[/green]" if step.meets_slos else "[red]missed[/red]",
        )  # fmt: skip
    out.print(t)
    if found.best is None or found.best_rate is None:
        out.print("[red]no rate met the SLOs[/red] " + ", ".join(escape(str(s)) for s in slos), highlight=False)
        return
    out.print(f"[bold green]highest rate meeting the SLOs: {found.best_rate:.2f} req/s[/bold green]", highlight=False)
    render_result(found.best, slos, out)


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v:.0%}"


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:,.0f}"
