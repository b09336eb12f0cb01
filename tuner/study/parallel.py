"""`tuner tune --parallel N`: N workers of one study on one box, each trial on GPUs of its own.

The workers are processes (multiprocessing, spawn), not threads:
- the load phase's client spends Python CPU on every streamed token (benchmarks/README, client CPU); threads of one
  interpreter would share one GIL and each trial's latencies would carry its neighbours' work;
- a worker is what the heartbeat guards: a killed process leaves its trial RUNNING for the heartbeat to fail and
  retry once, the multi-box path exactly; a thread cannot die alone;
- each keeps the one-worker code as it is (its own event loop per trial, storage engines, heartbeat thread,
  interruption path in the objective and the launcher), and shares the study through the storage as boxes do.
The parent shows the progress and relays Ctrl-C: every worker records its trial as interrupted and stops its server.

Storage: SQLite (in WAL mode) unless PostgreSQL is given, not Optuna's JournalStorage. Optuna's FAQ advises against
SQLite for parallel workers for two reasons, and both are answered here: enqueued trials are popped with SELECT ...
FOR UPDATE, which SQLite lacks (the study's ask() runs under the workers' lock, `Store.exclusive`), and "database is
locked" under concurrent writers (a 60 s busy timeout, WAL, and a handful of writes a trial minutes apart). Its
JournalStorage has no heartbeat (Optuna 5.1: it is not a BaseHeartbeat), and a killed worker's trial must be failed
by the heartbeat; and every morning command, the claims and the detail tables read the one SQLite file.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from tuner.config import Job
from tuner.errors import GPU_LOST, ConfigError, TunerError
from tuner.launch.factory import build_launcher
from tuner.launch.gpu_pool import GpuPool
from tuner.launch.pooled import PooledLauncher
from tuner.space import Choices, Range
from tuner.study.measure import Measure, measure_load
from tuner.study.storage import sqlite_wal

__all__ = ["ParallelReport", "WorkerEvent", "run_parallel", "trial_gpu_range", "worker_count"]

STOP_WAIT_S = 180.0
"""How long the parent waits for interrupted workers to stop their servers before it kills them (a Docker stop's
grace is 30 s; a killed worker's server is removed by the next run's leftover cleanup)."""


def trial_gpu_range(job: Job) -> tuple[int, int]:
    """The fewest and the most GPUs one trial of the space can need: tensor x pipeline parallel size (vLLM's world
    size, vllm/config/parallel.py ParallelConfig.__post_init__)."""
    low = high = 1
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        spec = job.space.get(name)
        if spec is None:
            continue
        if isinstance(spec, Choices):
            values = [int(v) for v in spec.choices]
        elif isinstance(spec, Range):
            values = [int(spec.low), int(spec.high)]
        else:
            values = [int(spec)] if isinstance(spec, int | float | str) else [1]
        low, high = low * max(1, min(values)), high * max(1, max(values))
    return low, high


def worker_count(given: str, job: Job, gpus: Sequence[str]) -> int:
    """`--parallel` as a number of workers: `auto` is the GPUs over the largest trial's; a number is checked against
    the GPUs (more workers than trials can run at once would only wait). One line for each mistake."""
    low, high = trial_gpu_range(job)
    text = given.strip().lower()
    if text != "auto":
        try:
            n = int(text)
        except ValueError:
            raise ConfigError(f"--parallel {given!r}: give a number of workers (1 or more) or auto") from None
        if n < 1:
            raise ConfigError(f"--parallel {n}: give a number of workers (1 or more) or auto")
        if n == 1:
            return 1
    where = f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}" + (f" ({', '.join(gpus)})" if gpus else "")
    if not gpus:
        raise ConfigError(
            f"--parallel {given}: no GPU found on this machine (NVML and amd-smi see none); each worker needs GPUs "
            "of its own: name the GPUs to use in CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES=0,1), or give "
            "--parallel 1"
        )
    if high > len(gpus):
        raise ConfigError(
            f"--parallel {given}: a trial of the space needs up to {high} GPUs (tensor x pipeline parallel size) and "
            f"this machine has {where}"
        )
    most = len(gpus) // low
    if text == "auto":
        return len(gpus) // high
    if n > most:
        size = f"of {low} GPU{'s' if low > 1 else ''} " if low > 1 else ""
        raise ConfigError(
            f"--parallel {n}: more workers than GPUs; this machine has {where}, which run at most {most} trial"
            f"{'s' if most > 1 else ''} {size}at once; give 1 to {most}, or auto"
        )
    return n


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    job: Job
    url: str
    pool: tuple[str, ...]
    home: tuple[str, ...]
    pool_dir: str | None
    measure: Measure
    poll_s: float


@dataclass(frozen=True)
class WorkerEvent:
    """What a worker tells the parent. kind: event (text), start (number), gpus (number, devices), end (trial),
    done (trials run, stopped by), failed (error class, message)."""

    worker: int
    kind: str
    args: tuple[Any, ...] = ()


@dataclass
class ParallelReport:
    trials_run: int = 0
    stopped_by: list[str] = field(default_factory=list)
    died: list[int] = field(default_factory=list)


def _on_sigterm(_signum: int, _frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second would cut the server's stop short
    raise KeyboardInterrupt


def _worker_main(spec: WorkerSpec, events: Any) -> None:
    """One worker process: the one-worker study run, its launcher lending GPUs from the box's pool."""
    from tuner.study.run import TuningRun

    # The terminal's Ctrl-C reaches every process of its group; the parent relays it as SIGTERM, once, so that an
    # interrupted stop is never interrupted again. A handler (not SIG_IGN) is reset at exec: servers keep SIGINT.
    signal.signal(signal.SIGINT, lambda _s, _f: None)
    signal.signal(signal.SIGTERM, _on_sigterm)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    from tuner.study.run import GpuLostStop

    def put(kind: str, *args: Any) -> None:
        events.put(WorkerEvent(spec.index, kind, args))

    pool = GpuPool(spec.pool, Path(spec.pool_dir) if spec.pool_dir else None)
    launcher = PooledLauncher(
        lambda devices: build_launcher(spec.job, devices),
        pool,
        home=spec.home,
        on_borrow=lambda trial, devices: put("gpus", trial, devices),
    )
    tuning = None
    code = 0
    try:
        tuning = TuningRun(
            spec.job,
            launcher,
            storage_url=spec.url,
            measure=spec.measure,
            on_event=lambda line: put("event", line),
            on_trial_start=lambda number: put("start", number),
            on_trial_end=lambda t: put("end", t),
            poll_s=spec.poll_s,
            worker=spec.index,
        )
        report = tuning.run()
        put("done", report.trials_run, report.stopped_by)
    except KeyboardInterrupt:
        put("failed", "interrupted", "")
        code = 130
    except GpuLostStop as e:  # this worker's GPU only: the others go on
        put("failed", GPU_LOST, str(e))
        code = 1
    except TunerError as e:
        put("failed", "ConfigError" if isinstance(e, ConfigError) else "TunerError", str(e))
        code = 2 if isinstance(e, ConfigError) else 1
    except BaseException as e:  # a bug: the parent says which worker and what, and stops the others
        put("failed", "crash", f"{type(e).__name__}: {e}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if tuning is not None:
            tuning.close()
        launcher.close()
        events.close()
        events.join_thread()  # every event reaches the parent before the process is gone
    os._exit(code)  # the code said; no interpreter teardown racing the queue's feeder thread


def run_parallel(
    job: Job,
    url: str,
    workers: int,
    gpus: Sequence[str],
    *,
    on_event: Callable[[WorkerEvent], None],
    measure: Measure = measure_load,
    pool_dir: Path | None = None,
    poll_s: float = 1.0,
) -> ParallelReport:
    """Run `workers` worker processes on the study until its budget is spent; their events go to `on_event` (in this
    process). Ctrl-C (KeyboardInterrupt here) interrupts every worker, waits for their servers to stop, re-raises."""
    if url.startswith("sqlite"):
        sqlite_wal(url)
    low, _ = trial_gpu_range(job)
    ids = tuple(gpus)
    GpuPool(ids, pool_dir).clear_lost()  # read afresh: a GPU lost in the last run may be back after a reset
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads and database connections
    events = ctx.Queue()
    procs = []
    for i in range(workers):
        spec = WorkerSpec(
            i, job, url, ids, ids[i * low : (i + 1) * low], str(pool_dir) if pool_dir else None, measure, poll_s
        )
        procs.append(ctx.Process(target=_worker_main, args=(spec, events), name=f"tuner-worker-{i + 1}"))
    report = ParallelReport()
    failure: WorkerEvent | None = None
    try:
        for p in procs:
            p.start()
        failure = _follow(procs, events, on_event, report)
    except KeyboardInterrupt:
        _interrupt(procs, events, on_event, report)
        raise
    finally:
        events.close()
    if len(report.died) == workers:
        raise TunerError(f"all {workers} workers died (killed: exit {procs[0].exitcode}); the same command continues")
    if failure is not None and failure.args[0] == GPU_LOST and not report.stopped_by:
        raise TunerError(failure.args[1])  # no worker was left to finish the study
    if failure is not None and failure.args[0] != GPU_LOST:
        kind, message = failure.args
        if kind == "ConfigError":
            raise ConfigError(message)
        raise TunerError(f"worker {failure.worker + 1} stopped: {message}" if kind == "crash" else message)
    return report


def _follow(
    procs: list[Any], events: Any, on_event: Callable[[WorkerEvent], None], report: ParallelReport
) -> WorkerEvent | None:
    """Relay events until every worker has exited; the first failure stops the others (their trials interrupted),
    except a worker's lost GPU, which stops that worker alone."""
    failure: WorkerEvent | None = None
    finished: set[int] = set()
    while True:
        try:
            event = events.get(timeout=0.2)
        except queue.Empty:
            for i, p in enumerate(procs):
                if p.exitcode is not None and i not in finished:
                    finished.add(i)
                    if p.exitcode not in (0, 1, 2, 130):  # killed: no event said why
                        report.died.append(i)
                        on_event(WorkerEvent(i, "died", (p.exitcode,)))
            if len(finished) == len(procs):
                return failure
            continue
        on_event(event)
        if event.kind == "done":
            report.trials_run += int(event.args[0])
            report.stopped_by.append(str(event.args[1]))
        elif event.kind == "failed" and event.args[0] != "interrupted":
            # A lost GPU (said already, through on_event) stops its worker alone; any other failure stops them all.
            stops_all = event.args[0] != GPU_LOST
            if failure is None or (stops_all and failure.args[0] == GPU_LOST):
                failure = event
                if stops_all:
                    _signal_all(procs, signal.SIGTERM)


def _signal_all(procs: list[Any], sig: signal.Signals) -> None:
    for p in procs:
        if p.exitcode is None and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)


def _interrupt(procs: list[Any], events: Any, on_event: Callable[[WorkerEvent], None], report: ParallelReport) -> None:
    """Ctrl-C: every worker interrupts its trial and stops its server; a further Ctrl-C does not cut that short."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _signal_all(procs, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while any(p.exitcode is None for p in procs if p.pid is not None) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                on_event(events.get(timeout=0.2))
        _signal_all(procs, signal.SIGKILL)
        for p in procs:
            if p.pid is not None:
                p.join()
        with contextlib.suppress(queue.Empty, OSError, ValueError):
            while True:
                on_event(events.get(timeout=0.1))
    finally:
        signal.signal(signal.SIGINT, previous)
