"""A trial's load phase against a ready server: a fixed load (objective throughput) or a capacity search (max_rate,
and goodput: the same search judged by the share of requests that met every latency SLO on their own)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tuner.box import replica_arrival, replicas
from tuner.clock import Clock
from tuner.config import Job
from tuner.flags import VllmFlags, resolve
from tuner.launch import Server
from tuner.launch.pinning import keep_to
from tuner.load import CapacityStep, LoadResult, find_max_rate, run_load

__all__ = ["Measure", "Measurement", "measure_load"]


@dataclass
class Measurement:
    """What a load phase gave: the scored result, and for a capacity search every step and the rate found."""

    result: LoadResult | None
    steps: list[CapacityStep] = field(default_factory=list)
    scored_step: int = 0
    rate: float | None = None
    # The servers of this shape the box holds; the load above was one replica's share (`tuner.box`).
    replicas: int = 1


Measure = Callable[[Server, Job, VllmFlags], Awaitable[Measurement]]


async def measure_load(server: Server, job: Job, flags: VllmFlags) -> Measurement:
    """The job's load phase against a ready server, timed on the server's clock (emulated seconds); on the cores
    the server's CPU plan left for the load client, off its worker's (vLLM's CPU build)."""
    if server.cpu_plan is None:
        return await _measure(server, job, flags)
    with keep_to(server.cpu_plan.cores("client")):
        return await _measure(server, job, flags)


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
