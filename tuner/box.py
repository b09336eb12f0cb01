"""The whole box: how many replicas of a server shape fill the job's GPUs, the load each one gets, and what the box
does and costs.

A load balancer in front of `replicas` identical servers hands each about 1/replicas of the users or of the rate,
so one server measured under that share stands for every replica, and the box does `replicas` times what it did.
Trials of different tensor/pipeline parallel shapes are then compared on the box's figure, not one server's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.load import Arrival

__all__ = ["SHAPE_DOES_NOT_FIT", "BoxFigures", "box_figures", "replica_arrival", "replicas", "shape_refusal"]

_MILLION = 1_000_000
SHAPE_DOES_NOT_FIT = "shape_does_not_fit"  # the reason a trial of a shape wider than the box is refused


def replicas(box_gpus: int, world_size: int) -> int:
    """How many servers of `world_size` GPUs (tensor x pipeline parallel) the box holds: 0 when not one fits."""
    return box_gpus // max(1, world_size)


def shape_refusal(box_gpus: int, world_size: int) -> str | None:
    """Why a server of `world_size` GPUs cannot run on the box (None: it fits)."""
    if replicas(box_gpus, world_size) >= 1:
        return None
    return (
        f"the shape needs {world_size} GPUs (tensor x pipeline parallel) and the box has {box_gpus} "
        "(target.gpus); not launched"
    )


def replica_arrival(arrival: Arrival, n_replicas: int) -> Arrival:
    """One replica's share of the job's load: 1/n of the closed loop's users (rounded up, at least 1, so the box
    is never offered less than the job's load) or of the open loop's rate (a trace's speed-up) and its in-flight
    cap. The request count stays the job's: each replica's measurement is as long as a lone server's."""
    if n_replicas <= 1:
        return arrival
    if arrival.concurrency is not None:
        return arrival.model_copy(update={"concurrency": max(1, math.ceil(arrival.concurrency / n_replicas))})
    # a trace's share is its slice played n times slower: each replica sees its bursts and lengths, at 1/n the rate
    update: dict[str, float | int] = (
        {"speedup": arrival.speedup / n_replicas}
        if arrival.trace is not None
        else {"rate": float(arrival.rate or 0.0) / n_replicas}
    )
    if arrival.max_in_flight is not None:
        update["max_in_flight"] = max(1, math.ceil(arrival.max_in_flight / n_replicas))
    return arrival.model_copy(update=update)


@dataclass(frozen=True)
class BoxFigures:
    """A trial's figures for the whole box. Cost figures are None without a price (or without throughput)."""

    replicas: int
    gpus: int  # the box's: a shape that leaves some idle still pays for them
    output_tok_s: float
    request_rate: float | None
    tok_s_per_gpu: float
    usd_per_m_tokens: float | None = None
    gpu_hours_per_m_requests: float | None = None


def box_figures(
    replica_tok_s: float,
    replica_rate: float | None,
    *,
    n_replicas: int,
    box_gpus: int,
    gpu_hour_usd: float | None,
) -> BoxFigures:
    """The box's throughput (replicas x one replica's), its per-GPU figure, $ per million output tokens at that
    throughput and GPU-hours per million requests at the box's request rate; the whole box is paid for, a GPU a shape
    leaves idle included."""
    gpus = max(1, box_gpus)
    tok_s = replica_tok_s * n_replicas
    rate = replica_rate * n_replicas if replica_rate is not None else None
    usd = None
    if gpu_hour_usd is not None and tok_s > 0:
        usd = gpu_hour_usd * gpus / (tok_s * 3600) * _MILLION
    gpu_hours = gpus / (rate * 3600) * _MILLION if rate else None
    return BoxFigures(n_replicas, gpus, tok_s, rate, tok_s / gpus, usd, gpu_hours)
