"""A trial's load phase against a ready server: a fixed load (objective throughput) or a capacity search (max_rate,
and goodput: the same search judged by the share of requests that met every latency SLO on their own)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from tuner.box import replica_arrival, replicas
from tuner.clock import Clock
from tuner.config import Job
from tuner.flags import VllmFlags, resolve
from tuner.launch import Server
from tuner.launch.pinning import keep_to
from tuner.load import CapacityStep, LoadResult, find_max_rate, run_load
from tuner.load.contention import Contention, lag_share, lag_share_limit
from tuner.load.emulator_lag import read_emulator_lag, reset_emulator_prefix_cache
from tuner.load.host_contention import HostSampler, between

__all__ = ["REMEASURES", "Measure", "Measurement", "measure_load", "measure_watched", "watch_server"]

REMEASURES = 2
"""Runs of the load phase again, on the same server, when the emulator lagged behind its clock in the last one."""


@dataclass
class Measurement:
    """What a load phase gave: the scored result, and for a capacity search every step and the rate found."""

    result: LoadResult | None
    steps: list[CapacityStep] = field(default_factory=list)
    scored_step: int = 0
    rate: float | None = None
    # The servers of this shape the box holds; the load above was one replica's share (`tuner.box`).
    replicas: int = 1
    # What the machine was doing during the load phase that gave these figures (tuner.load.contention).
    contention: Contention | None = None


Measure = Callable[[Server, Job, VllmFlags], Awaitable[Measurement]]


async def measure_load(server: Server, job: Job, flags: VllmFlags) -> Measurement:
    """The job's load phase against a ready server, timed on the server's clock (emulated seconds); on the cores
    the server's CPU plan left for the load client, off its worker's (vLLM's CPU build). The host is read around
    it; an emulator that lagged behind its clock has its run measured again (`measure_watched`)."""

    async def once() -> Measurement:
        if server.cpu_plan is None:
            return await _measure(server, job, flags)
        with keep_to(server.cpu_plan.cores("client")):
            return await _measure(server, job, flags)

    return await watch_server(server, once)


LagRead = Callable[[str], Awaitable[float | None]]


async def watch_server(
    server: Server, run: Callable[[], Awaitable[Measurement]], *, transport: httpx.AsyncBaseTransport | None = None
) -> Measurement:
    """`run` under `measure_watched`, the emulator's own routes asked only of a server its launcher knows to be the
    emulator (`Server.emulator`): a real vLLM answers them 404 and logs each one. `transport`: the probes' client's
    (a test's httpx.MockTransport)."""
    # A container's processes are the server's, though not the tuner's children (a test's fake server has none).
    roots = server.root_pids() if hasattr(server, "root_pids") else ()
    if not getattr(server, "emulator", False):
        return await measure_watched(
            run, server.base_url, server.time_scale, sampler=HostSampler(also=roots), read_lag=_no_lag, reset=_no_reset
        )

    async def read_lag(base_url: str) -> float | None:
        return await read_emulator_lag(base_url, transport=transport)

    async def reset(base_url: str) -> None:
        await reset_emulator_prefix_cache(base_url, transport=transport)

    return await measure_watched(
        run, server.base_url, server.time_scale, sampler=HostSampler(also=roots), read_lag=read_lag, reset=reset
    )


async def _no_lag(base_url: str) -> float | None:
    return None


async def _no_reset(base_url: str) -> None:
    return None


async def measure_watched(
    run: Callable[[], Awaitable[Measurement]],
    base_url: str,
    time_scale: float,
    *,
    sampler: HostSampler | None = None,
    read_lag: LagRead = read_emulator_lag,
    reset: Callable[[str], Awaitable[None]] = reset_emulator_prefix_cache,
) -> Measurement:
    """`run` with the host read around it and the emulator's lag read before and after (None: not an emulator);
    a run whose engine lost more than lag_share_limit() of its duration is run again, up to REMEASURES times; the
    last run is kept, marked `lagged` when every run lagged."""
    sampler = sampler or HostSampler()
    limit = lag_share_limit()
    again = 0
    while True:
        lag_before = await read_lag(base_url)
        before = sampler.read()
        measurement = await run()
        after = sampler.read()
        # a server that did not answer before the run is not the emulator: vLLM's log keeps one 404, not two
        lag_after = await read_lag(base_url) if lag_before is not None else None
        contention = between(before, after)
        lag = lag_after - lag_before if lag_after is not None and lag_before is not None else None
        share = lag_share(lag, (contention.seconds or 0.0) * time_scale)
        lagged = share is not None and share > limit
        measurement.contention = contention.model_copy(
            update={
                "time_scale": time_scale,
                "emulator_lag_s": lag,
                "emulator_lag_share": share,
                "lagged": lagged,
                "measured_again": again,
            }
        )
        if not lagged or again >= REMEASURES:
            return measurement
        again += 1
        await reset(base_url)  # the run again as cold as the first: no prefix-cache hits on its own prompts


async def _measure(server: Server, job: Job, flags: VllmFlags) -> Measurement:
    clock = Clock(server.time_scale)
    seqs = resolve(flags, job.gpu_profile(), job.model_profile()).max_num_seqs
    slos = job.parsed_slos()
    # One replica of the box's, under its share of the job's load: what a load balancer in front would give it.
    n = max(1, replicas(job.box_gpus(), flags.world_size))
    if job.objective == "throughput":
        result = await run_load(
            server.base_url,
            server.model,
            job.workload,
            replica_arrival(job.arrival, n),
            slos=slos,
            clock=clock,
            request_timeout_s=job.request_timeout,
            max_num_seqs=seqs,
            stop_on_slo_miss=job.stop_early,
        )
        return Measurement(result, rate=result.summary.request_throughput, replicas=n)
    search = await find_max_rate(
        server.base_url,
        server.model,
        job.workload,
        slos,
        clock=clock,
        requests_per_step=job.capacity_search.requests_per_step,
        max_steps=job.capacity_search.max_steps,
        request_timeout_s=job.request_timeout,
        seed=job.workload.seed,
        max_num_seqs=seqs,
        stop_on_slo_miss=job.stop_early,
        judge=[job.goodput_slo()] if job.objective == "goodput" else None,
        trace=job.arrival if job.arrival.trace is not None else None,  # replayed faster or slower to each rate
    )
    scored = 0
    if search.best_rate is not None:
        scored = next((i for i, s in enumerate(search.steps) if s.rate == search.best_rate and s.meets_slos), 0)
    return Measurement(search.best, list(search.steps), scored, search.best_rate, replicas=n)
