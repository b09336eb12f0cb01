"""What `tuner tune` says of a cost study (tuner.cost) as it starts and runs: the directions, the load the box is
sized for, each trial's box and cost, the cheapest so far."""

from __future__ import annotations

from tuner.config import Job
from tuner.record import TrialRecord

__all__ = ["best_cost_text", "cost_box_text", "directions_text", "trial_cost_part"]


def directions_text(job: Job) -> str:
    """The study's two directions as a person reads them."""
    latency = job.primary_latency()
    if job.objective != "cost":
        return f"objective: {job.objective}; directions: maximize output tok/s, minimize {latency}"
    per = "$" if job.gpu_hour_usd() is not None else "GPU-hour"
    return (
        f"objective: cost; directions: minimize the cost of the job's load (maximize million output tokens per "
        f"{per}), minimize {latency}"
    )


def cost_box_text(job: Job) -> str:
    """The load a cost study sizes each shape's deployment for, and what it is priced at."""
    load = job.cost_load()
    priced = job.gpu_hour_text() or "no price (target.gpu_hour_usd): scored in GPU-hours"
    if load is not None and load.users is not None:
        served = f"{load.users} users (sized by Little's law: a replica serves the requests it held in flight)"
    else:
        served = f"{load.rate if load is not None else 0:g} req/s"
    return (
        f"cost: each shape's capacity within the SLOs, then ceil(load / capacity) replicas for {served}; "
        f"a shape may span at most {job.box_gpus()} GPUs (target.gpus); {priced}"
    )


def trial_cost_part(r: TrialRecord) -> str:
    """`3 x 2 GPUs for 12 req/s: $1.23 per M output tokens` for a cost trial; '' for any other."""
    if r.cost_gpu_hours_per_m_tokens is None or r.replicas is None or r.box_gpus is None:
        return ""
    each = r.box_gpus // max(1, r.replicas)
    what = (
        f"${r.cost_usd_per_m_tokens:,.2f} per M output tokens (${r.cost_usd_per_hour:,.2f}/h)"
        if r.cost_usd_per_m_tokens is not None and r.cost_usd_per_hour is not None
        else f"{r.cost_gpu_hours_per_m_tokens:,.2f} GPU-h per M output tokens"
    )
    return f"{r.replicas}×{each} GPUs for {r.cost_load_rate or 0:.2f} req/s: {what}"


def best_cost_text(number: int, r: TrialRecord) -> str:
    """`cheapest: #3 $3.47/M tok, 6×1 GPUs`: short, as the progress bar's column holds it in 80 columns."""
    each = (r.box_gpus or 1) // max(1, r.replicas or 1)
    per_m = (
        f"${r.cost_usd_per_m_tokens:,.2f}/M tok"
        if r.cost_usd_per_m_tokens is not None
        else f"{r.cost_gpu_hours_per_m_tokens or 0:,.2f} GPU-h/M tok"
    )
    return f"cheapest: #{number} {per_m}, {r.replicas}×{each} GPUs"
