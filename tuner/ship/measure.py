"""`tuner plan --measure`: a winner's highest SLO-meeting rate measured now, when its study did not measure it.

A `throughput` study holds the rate each trial kept under the job's fixed load, a floor of its capacity. The
capacity search the `max_rate` objective runs (tuner.load.find_max_rate) is run once on the winner's flags, on a
server the study's own launcher starts, with the study's workload and SLOs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from tuner.config import Job
from tuner.errors import LaunchError, TunerError
from tuner.flags import VllmFlags
from tuner.launch import Launcher
from tuner.launch.factory import build_launcher
from tuner.study.measure import Measure, measure_load

__all__ = ["MeasuredCapacity", "measure_capacity"]


@dataclass(frozen=True)
class MeasuredCapacity:
    rate: float  # req/s: the highest rate whose step met every SLO
    tokens_per_request: float | None
    steps: int  # load steps the search ran

    @property
    def basis(self) -> str:
        return f"its highest SLO-meeting rate, measured now by a capacity search of {self.steps} steps"


def measure_capacity(
    job: Job,
    flags: VllmFlags,
    *,
    study: str,
    trial: int,
    launcher: Launcher | None = None,
    measure: Measure = measure_load,
) -> MeasuredCapacity:
    """Start `flags` with the job's launcher and search the highest SLO-meeting rate on that one server."""
    # A goodput study's capacity is its goodput search's rate; any other study's, the SLO-meeting one.
    search = job.model_copy(update={"objective": "goodput" if job.objective == "goodput" else "max_rate"})

    async def go() -> MeasuredCapacity | None:
        async with (launcher or build_launcher(job)).start(flags, study=study) as server:
            m = await measure(server, search, flags)
        if m.rate is None or m.rate <= 0:
            return None
        summary = m.result.summary if m.result is not None else None
        tokens = None
        if summary is not None and summary.requests_succeeded > 0 and summary.completion_tokens > 0:
            tokens = summary.completion_tokens / summary.requests_succeeded
        return MeasuredCapacity(m.rate, tokens, len(m.steps))

    try:
        found = asyncio.run(go())
    except LaunchError as e:
        raise TunerError(f"--measure: trial {trial}'s flags did not start ({e.reason}): {e}") from None
    if found is None:
        slos = "; ".join(job.slos)
        raise TunerError(f"--measure: trial {trial}'s flags met the SLOs ({slos}) at no rate the search tried")
    return found
