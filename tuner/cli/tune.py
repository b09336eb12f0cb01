"""`tuner tune JOB.yaml` (run the overnight study), `tuner schema` (the job file's schema), `tuner db upgrade`."""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import optuna
import typer
from optuna.trial import FrozenTrial, TrialState
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tuner.box import replica_arrival, replicas
from tuner.cli import app
from tuner.cli.cost_lines import cost_box_text, directions_text
from tuner.cli.extras import need_job_extras, need_storage_driver
from tuner.cli.progress_lines import PlainProgress
from tuner.cli.trial_lines import (
    TextLog,
    best_text,
    closing_once,
    console,
    count_done,
    fit_console_to_output,
    front_line,
    pareto_table,
    search_trace_rate,
    short_flags,
    trial_line,
)
from tuner.config import Job, job_schema, load_job
from tuner.errors import ConfigError, StorageError, TunerError
from tuner.feasibility import FeasibilityModel
from tuner.launch.factory import cpu_plan
from tuner.space import describe_distribution
from tuner.store import make_engine, safe_url, upgrade
from tuner.study.measure import Measure, measure_load

db_app = typer.Typer(
    name="db",
    rich_markup_mode="rich",
    no_args_is_help=True,
    help="The project's own tables beside the Optuna study.\n\nExample: [bold]tuner db upgrade --storage sqlite:///study.db[/bold]",
)
app.add_typer(db_app)


def make_progress() -> Progress | PlainProgress:
    """Rich's bar on a terminal; a plain line a finished trial (and every few minutes) in a file or a pipe."""
    if not fit_console_to_output():
        return PlainProgress(console)
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[best]}"),
        console=console,
        transient=False,
    )


def trace_lines(job: Job) -> list[str]:
    """A trace's note (sorted), and the shape of the slice the trials replay."""
    a = job.arrival
    if a.trace is None:
        return []
    from tuner.load.trace_replay import slice_shape

    note = a.load_trace().note
    lines = [*([f"note: {note}"] if note else []), *slice_shape(a.trace_requests(), a.block_tokens).lines()]
    own = a.trace_rate()
    if job.objective in ("max_rate", "goodput") and own is not None:
        start = (
            f"at x{a.speedup:g} ({a.speedup * own:.2f} req/s: arrival.speedup)"
            if a.speedup != 1
            else "at the rate a probe of its requests serves (32 in flight)"
        )
        # lines shorter than 80 columns, as the slice's shape above
        lines += [
            f"{job.objective} search: each step replays the slice sped up to the rate it tries,",
            f"  speed-up = rate / {own:.2f} req/s; its bursts, lengths and shared blocks kept",
            f"  {len(a.trace_requests())} requests a step (capacity_search.requests_per_step does not apply)",
            f"  the first step {start}",
            f"  at most {job.capacity_search.max_steps} steps (capacity_search.max_steps)",
        ]
    return lines


def box_text(job: Job, baseline_world_size: int) -> str | None:
    """The box the study fills (`target.gpus`) and its price, said where they change what a trial is."""
    gpus, price = job.box_gpus(), job.gpu_hour_text()
    cost = f"; {price}" if price is not None else ""
    if gpus == 1:  # the catalog's default price changes nothing here: said where the cost is scored
        return f"box: 1 GPU{cost}" if job.target.gpu_hour_usd is not None else None
    n = replicas(gpus, baseline_world_size)
    share = replica_arrival(job.arrival, max(n, 1)).describe()
    return (
        f"box: {gpus} GPUs (target.gpus): a shape runs as {gpus} // (tensor x pipeline parallel) replicas, scored "
        f"together; the baseline's {n} each get {share}{cost}"
    )


def dry_run(job: Job, url: str, *, launching: bool = False) -> None:
    """Check the job, show the space, the baseline and what the feasibility filter predicts, launch nothing."""
    from tuner.study.samplers import sampler_name

    space = job.search_space()
    gpu = job.gpu_profile()
    device = gpu.device_name if gpu.is_cpu else f"{gpu.device_name} ({gpu.memory_gib:g} GiB)"
    console.print(f"[bold]{job.study.name}[/bold]: {job.target.model} on {device} via {job.target.launcher}")
    console.print(f"storage: {safe_url(url)}")
    console.print(directions_text(job))
    options = job.sampler.model_dump(exclude={"name", "seed"}, exclude_none=True)
    sampler = sampler_name(job) + "".join(f", {k}: {str(v).lower()}" for k, v in options.items())
    console.print(f"SLOs: {', '.join(job.slos)}; budget: {job.budget.n_trials} trials; sampler: {sampler}")
    shape = f"{job.workload.conversations.describe()}; " if job.workload.conversations is not None else ""
    console.print(
        f"workload: {shape}longest request {job.longest_request()} tokens; arrival: {job.arrival.describe()}",
        markup=False,
    )
    for line in trace_lines(job):
        console.print(line, markup=False)
    box = cost_box_text(job) if job.objective == "cost" else box_text(job, space.baseline().world_size)
    if box:
        console.print(box)
    for name, dist in space.distributions.items():
        console.print(f"  {name}: {describe_distribution(dist)}", markup=False)
    for name, value in space.fixed.items():
        console.print(f"  {name}: {value} (fixed)")
    for note in space.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if (plan := cpu_plan(job)) is not None:
        console.print(plan.describe())
    fm = FeasibilityModel(job.gpu_profile(), job.model_profile(), margin=job.feasibility.margin)
    base = space.baseline()
    p = fm.predict(base)
    verdict = p.describe()
    # The verdict on a line of its own: flags and verdict together overrun 80 columns mid-phrase.
    console.print(f"baseline (vLLM's defaults): {short_flags(base.as_dict())}")
    console.print(f"  -> {verdict}")
    # What the filter would spare: a random sample of the space, predicted.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        probe = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), directions=["maximize", "minimize"])
    reasons: dict[str, int] = {}
    n = 64
    for _ in range(n):
        trial = probe.ask()
        s = space.suggest(trial)
        pr = fm.predict(s.flags)
        key = ("starts" if pr.predicted else "no prediction") if pr.ok else str(pr.reason)
        reasons[key] = reasons.get(key, 0) + 1
        probe.tell(trial, state=TrialState.PRUNED)
    console.print(f"of {n} random flag sets: " + ", ".join(f"{v} {k}" for k, v in sorted(reasons.items())))
    reach_check(job)
    stored_job_check(job, url)
    console.print("[green]job file is valid[/green]" + ("" if launching else "; nothing was launched"))


def preflight_check(job: Job) -> None:
    """Start the baseline's server, send it the preflight's probe requests, stop it; record nothing."""
    from tuner.launch.factory import build_launcher
    from tuner.study.preflight import PreflightResult, check_workload

    launcher = build_launcher(job)
    flags = job.search_space().baseline()
    console.print(f"preflight: starting the baseline's server ({job.target.launcher}) and probing it ...")

    async def probe() -> PreflightResult:
        async with launcher.start(flags, study=job.study.name) as server:
            return await check_workload(server, job, flags)

    result = asyncio.run(probe())  # a refusal raises WorkloadRejected: one line and exit 1, as `tuner tune` would
    if not result.passed:
        raise TunerError(f"preflight inconclusive: {result.note}")
    console.print(f"[green]preflight passed[/green]: {result.note}; the server is stopped, nothing was recorded")


NewStudyOpt = Annotated[
    str | None,
    typer.Option(
        "--new-study",
        help="run the job as a new study of this name in the same storage (where the job's study was measured "
        "under another workload, arrival, model, GPU or launcher, and refuses it)",
        metavar="NAME",
    ),
]


@app.command(
    help="Run the tuning study of a job file to its budget: launch a server per proposed flag set, measure it under "
    "the job's load, keep the feasible Pareto front of throughput against P95 latency. Run it again to continue; "
    "run it on several machines with one PostgreSQL --storage to scale out, or on every GPU of this one with "
    "--parallel. The job's `sampler` picks the search (twin, tpe, gp, nsga2, random, grid) and its options, e.g. "
    "`sampler: {name: tpe, multivariate: false}`; `tuner schema` lists them.\n\n"
    "Example: [bold]tuner tune search_spaces/emulator-demo.yaml[/bold]\n\n"
    "Example: [bold]tuner tune search_spaces/emulator-trace.yaml --dry-run[/bold]   (a request log replayed: the "
    "slice's shape; docs/guides/traces.md)\n\n"
    "Example: [bold]tuner tune search_spaces/emulator-trace-goodput.yaml[/bold]   (objective: goodput on a trace: "
    "how much faster than logged the traffic can come, each trial replaying it sped up to the rates it tries)\n\n"
    "Example: [bold]tuner tune job.yaml --parallel auto[/bold]   (8 GPUs, tensor_parallel_size 2: 4 workers)\n\n"
    "Example: [bold]tuner tune job.yaml --new-study night-1024[/bold]   (the job's workload edited: a new study "
    "beside the old one in the same storage; a rerun checks its job against the stored one)"
)
def tune(
    job_file: Annotated[Path, typer.Argument(help="the job file (YAML)", metavar="JOB.yaml")],
    storage: Annotated[
        str | None,
        typer.Option(
            help="storage URL, overriding the job file's (sqlite:///x.db, postgresql+psycopg://...)",
            envvar="TUNER_STORAGE_URL",
        ),
    ] = None,
    dry_run_: Annotated[
        bool, typer.Option("--dry-run", help="check the job and show predictions; launch nothing")
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="the dry run, then start the baseline's server and send it a few requests of the workload (the "
            "preflight every study runs first); record nothing. Run it before leaving a study overnight.",
        ),
    ] = False,
    log_file: Annotated[Path | None, typer.Option(help="also write a plain-text log here")] = None,
    n_trials: Annotated[int | None, typer.Option(help="override the job's budget.n_trials")] = None,
    parallel: Annotated[
        str,
        typer.Option(
            "--parallel",
            help="workers on this machine, each trial on GPUs of its own (CUDA_VISIBLE_DEVICES, Docker device_ids) "
            "from the GPUs NVML sees (or CUDA_VISIBLE_DEVICES given to tuner); a trial takes tensor x pipeline "
            "parallel size of them. auto: the GPUs over the largest trial's. One study, one storage.",
            metavar="N|auto",
        ),
    ] = "1",
    new_study: NewStudyOpt = None,
) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fit_console_to_output()
    job = load_job(job_file)
    if n_trials is not None:
        job = job.model_copy(update={"budget": job.budget.model_copy(update={"n_trials": n_trials})})
    url = storage or job.storage_url()
    need_job_extras(job, url)  # the dry run too: a job it calls valid runs
    if new_study is not None:
        job = _renamed(job, new_study)
    if not (dry_run_ or check) and job.arrival.trace is not None and (note := job.arrival.load_trace().note):
        console.print(f"note: {note}", markup=False)
    from tuner.study.parallel import worker_count

    gpus = _parallel_gpus(parallel)
    workers = worker_count(parallel, job, gpus)
    if dry_run_ or check:
        dry_run(job, url, launching=check)
        if workers > 1:
            console.print(f"--parallel {parallel}: {workers} workers on GPUs {', '.join(gpus)}")
        if check:
            preflight_check(job)
        return
    run(job, url, log_file, workers=workers, gpus=gpus)


def reach_check(job: Job) -> None:
    """An SLO the twin predicts no flag set meets: which, the nearest flag set and by how much (nothing said where
    some flag set is likely to meet them all, or the twin cannot imitate the job)."""
    from tuner.twin.reachability import predict_unreachable
    from tuner.twin.sampler import twin_unsupported

    if twin_unsupported(job) is not None:
        return
    found = predict_unreachable(job, max_points=48, seed=job.sampler.seed)
    if found is None:
        return
    then = (
        "the study stops once the baseline and the twin's nearest flag sets measured missing it"
        if job.budget.stop_when_unreachable
        else "the study spends its budget anyway (budget.stop_when_unreachable: false)"
    )
    console.print(f"[yellow]unreachable:[/yellow] {escape(found.line())}; {then}")


def _renamed(job: Job, name: str) -> Job:
    """The job as study `name` (--new-study), in the storage its own name gave it."""
    if not name.strip() or len(name) > 200:
        raise ConfigError(f"--new-study {name!r}: give a study name of 1 to 200 characters")
    return job.model_copy(update={"study": job.study.model_copy(update={"name": name})})


def stored_job_check(job: Job, url: str) -> None:
    """What a run would find of the job's study in its storage: what changed from the stored job and what the run
    does about it (ConfigError where it would refuse); nothing written, no storage created."""
    from sqlalchemy.engine import make_url

    from tuner.report.rejudge import rejudge
    from tuner.store import open_store
    from tuner.study.job_check import settle_job
    from tuner.study.storage import make_storage

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and not Path(parsed.database or "").is_file():
        return
    try:
        storage = make_storage(
            url, heartbeat_interval=job.study.heartbeat_interval, grace_period=job.study.grace_period
        )
    except StorageError as e:
        console.print(f"the stored job was not compared: {e}", markup=False)  # the dry run needs no database
        return
    lines: list[str] = []
    try:
        if job.study.name not in {s.study_name for s in storage.get_all_studies()}:
            return
        with open_store(url) as store:
            change = settle_job(storage, store, job, job.search_space(), lines.append, rejudge=rejudge, write=False)
        if not change.changes:
            lines.append(f"study {job.study.name!r} exists with this job: a run continues it")
    finally:
        storage.engine.dispose()
    for line in lines:
        console.print(line, markup=False)


def _parallel_gpus(parallel: str) -> tuple[str, ...]:
    """The device ids the workers share: read only when --parallel asks for more than one worker."""
    if parallel.strip() == "1":
        return ()
    from tuner.catalog.nvml import machine_devices
    from tuner.launch.gpu_pool import visible_ids

    return visible_ids([d.index for d in machine_devices()])


def run(
    job: Job,
    url: str,
    log_file: Path | None = None,
    *,
    workers: int = 1,
    gpus: Sequence[str] = (),
    measure: Measure | None = None,
) -> None:
    """The study to its budget: by this process, or by `workers` worker processes sharing `gpus`."""
    if workers > 1:
        from tuner.cli.tune_workers import run_workers

        run_workers(job, url, log_file, workers=workers, gpus=gpus, measure=measure or measure_load)
        return
    from tuner.launch.factory import build_launcher
    from tuner.report.rejudge import rejudge
    from tuner.study import TuningRun

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    log = TextLog(log_file)
    launcher = build_launcher(job)
    for line in launcher.cleanup_leftovers(job.study.name):
        console.print(f"cleaned up: {line}")
        log(f"cleaned up: {line}")
    progress = make_progress()
    state: dict[str, Any] = {"task": None, "run": None}

    def say(line: str) -> None:
        progress.console.print(line, markup=False)  # a record's `[same flags as #2]` is text, not a style
        log(line)

    def on_start(number: int) -> None:
        r = state["run"]
        progress.update(state["task"], description=f"trial #{number}", completed=count_done(r.study))

    trace_rate = search_trace_rate(job)

    def on_end(t: FrozenTrial) -> None:
        r = state["run"]
        say(trial_line(t, trace_rate))
        progress.update(state["task"], completed=count_done(r.study), best=best_text(r.study))

    tuning = TuningRun(
        job,
        launcher,
        storage_url=url,
        on_event=say,
        on_trial_start=on_start,
        on_trial_end=on_end,
        measure=measure or measure_load,
        rejudge=rejudge,
    )
    state["run"] = tuning
    started = time.monotonic()
    try:
        with progress:
            done = count_done(tuning.study)
            state["task"] = progress.add_task(
                "starting", total=job.budget.n_trials, completed=done, best=best_text(tuning.study)
            )
            say(f"study {job.study.name!r} in {safe_url(url)}: {done}/{job.budget.n_trials} trials done")
            report = tuning.run()
        took = time.monotonic() - started
        say(
            f"finished ({report.stopped_by}) after {took:.0f}s; {report.trials_run} trials run by this worker; "
            f"{report.distinct} distinct flag sets tried ({report.measured} measured), {report.repeats_said()} "
            "(not counted in the budget); "
            f"{report.confirmation_starts} confirmation starts (budget.confirm)"
        )
        console.print(pareto_table(tuning.study))
        for line in closing_once(report.closing):  # how sure the result is: the confirmation's verdict
            say(line)
        log(front_line(tuning.study))
    except KeyboardInterrupt:
        say("interrupted: the running trial is recorded as interrupted and will run again; the same command continues")
        raise typer.Exit(130) from None
    except TunerError as e:
        log(f"error: {e}")  # the log read in the morning says why the study stopped, as the terminal did
        log.details(e)  # and what lay behind it, which the terminal's one line leaves out
        raise
    finally:
        tuning.close()
        log.close()


@app.command(
    help="Print the JSON Schema of job files (for editors: yaml-language-server, VS Code).\n\n"
    "Example: [bold]tuner schema > job.schema.json[/bold]"
)
def schema() -> None:
    typer.echo(json.dumps(job_schema(), indent=2))


@db_app.command(
    "upgrade",
    help="Create or migrate the project's tables in a study database (tuner tune does this by itself).\n\n"
    "Example: [bold]tuner db upgrade --storage postgresql+psycopg://tuner:PASSWORD@db/tuner[/bold]",
)
def db_upgrade(
    storage: Annotated[
        str | None, typer.Option(help="storage URL of the study database", envvar="TUNER_STORAGE_URL")
    ] = None,
    job_file: Annotated[Path | None, typer.Option("--job", help="take the storage URL from this job file")] = None,
) -> None:
    if storage is not None:
        url = storage
    elif job_file is not None:
        url = load_job(job_file).storage_url()
    else:
        raise ConfigError("tuner db upgrade: give --storage URL or --job JOB.yaml")
    need_storage_driver(url)
    engine = make_engine(url)
    try:
        revision = upgrade(engine)
    finally:
        engine.dispose()
    console.print(f"{safe_url(url)}: tuner tables at revision {revision}")
