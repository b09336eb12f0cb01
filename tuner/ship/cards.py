"""`tuner plan --compare-gpus`: catalog cards ranked by what the plan's load would need on each, as the twin predicts.

For each card the twin (tuner.twin.simulate: the emulator's engine in virtual time, the catalog's figures for the card)
probes a bounded sample of the study's search space (every server shape in it), takes the few flag sets that serve the
most requests a GPU at a full batch, and searches each one's highest rate that meets the study's SLOs, much as
`tuner plan --measure` does on a real server: from the saturated rate down, open-loop steps halved then bisected.
No server is started. The card's best flag set is the
one that needs the fewest GPUs for the load; the cards are then ranked by $/hour where every card has a price (given,
or the catalog's where it can cite one), else by GPUs needed. Every figure is a prediction from the catalog's
datasheet figures, not fit to the study's trials (they ran on one card; the fit does not carry to another).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tuner.catalog.gpus import GPUS
from tuner.config import Job
from tuner.errors import ConfigError
from tuner.flags import VllmFlags
from tuner.load import Arrival
from tuner.scoring import LoadSummary, Slo
from tuner.twin.model import candidates
from tuner.twin.simulate import simulate

__all__ = ["CardPick", "CardPlan", "best_on_card", "compare_cards", "parse_cards", "parse_prices", "twin_capacity"]

FLAG_SETS = 12  # of the study's space, probed on each card
SEARCHED = 3  # of those, the most requests a GPU in the probe, given a capacity search each
PROBE_USERS = 128  # the probe's closed loop: the batch filled, at most this many users
TOLERANCE = 0.1  # the capacity search stops once its bounds are this close
TWIN_STEPS = 8  # a step in the twin costs a fraction of a second: enough to bisect to TOLERANCE from the probe
# A step must be long enough for a queue to build past the SLOs when the rate is too high: a few dozen requests
# arrive as one batch at any rate and meet them all. The twin's steps are cheap; a real search's are not.
STEP_REQUESTS = 200


def parse_cards(text: str) -> list[str]:
    """`h100-80gb,a100-80gb,l40s` as catalog keys, in the order given; an unknown one is one clear line."""
    cards = [c.strip().lower() for c in text.split(",") if c.strip()]
    unknown = [c for c in cards if c not in GPUS or GPUS[c].is_cpu]
    if unknown or not cards:
        allowed = ", ".join(k for k, g in GPUS.items() if not g.is_cpu)
        raise ConfigError(f"--compare-gpus: unknown card {', '.join(unknown) or repr(text)}; allowed: {allowed}")
    return list(dict.fromkeys(cards))


def parse_prices(text: str | None) -> dict[str, float]:
    """`h100-80gb=3.5,l40s=1.2` as USD per GPU-hour by catalog key."""
    prices: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        card, _, value = item.partition("=")
        card = card.strip().lower()
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if card not in GPUS or not price > 0 or not math.isfinite(price):
            raise ConfigError(
                f"--gpu-hour-usd {item.strip()!r}: give CARD=USD per GPU-hour above 0, e.g. h100-80gb=3.5,l40s=1.2, "
                f"with a card of {', '.join(GPUS)}"
            )
        prices[card] = price
    return prices


@dataclass(frozen=True)
class CardPick:
    """The twin's best flag set on one card and one server's predicted capacity with it (None: none met the SLOs)."""

    card: str
    flags: VllmFlags | None
    capacity_rps: float | None
    tokens_per_request: float | None
    tried: int  # flag sets the twin probed
    why: str | None = None  # why no flag set is offered

    @property
    def world_size(self) -> int:
        return self.flags.world_size if self.flags is not None else 1


@dataclass(frozen=True)
class CardPlan:
    """One card's pick sized for the plan's rate: servers of its shape, GPUs, and the cost where a price is known."""

    pick: CardPick
    rate: float
    headroom: float
    price: float | None  # USD per GPU-hour
    price_source: str | None

    @property
    def servers(self) -> int | None:
        cap = self.pick.capacity_rps
        return math.ceil(self.rate / (cap * self.headroom)) if cap else None

    @property
    def gpus(self) -> int | None:
        return None if self.servers is None else self.servers * self.pick.world_size

    @property
    def usd_per_hour(self) -> float | None:
        return None if self.gpus is None or self.price is None else self.gpus * self.price

    @property
    def usd_per_m_tokens(self) -> float | None:
        tokens = self.pick.tokens_per_request
        if self.usd_per_hour is None or not tokens:
            return None
        return self.usd_per_hour / (self.rate * tokens * 3600 / 1e6)

    def as_dict(self) -> dict[str, object]:
        p = self.pick
        return {
            "card": p.card,
            "flags": p.flags.as_dict() if p.flags is not None else None,
            "world_size": p.world_size,
            "capacity_rps": p.capacity_rps,
            "output_tok_s": p.capacity_rps * p.tokens_per_request if p.capacity_rps and p.tokens_per_request else None,
            "tokens_per_request": p.tokens_per_request,
            "flag_sets_tried": p.tried,
            "why": p.why,
            "servers": self.servers,
            "gpus": self.gpus,
            "gpu_hour_usd": self.price,
            "price_source": self.price_source,
            "usd_per_hour": self.usd_per_hour,
            "usd_per_m_tokens": self.usd_per_m_tokens,
            "predicted": True,
        }


def on_card(job: Job, card: str) -> Job:
    """The job as it would run on `card`: the catalog's figures, no calibrated profile (it was fit to another)."""
    return job.model_copy(update={"target": job.target.model_copy(update={"gpu": card, "profile": None})})


def _judged(job: Job) -> list[Slo]:
    # A goodput study's capacity is the rate at which the SLOs' share of requests are good, as its search judges it.
    return [job.goodput_slo()] if job.objective == "goodput" else job.parsed_slos()


def _run(job: Job, flags: VllmFlags, arrival: Arrival) -> LoadSummary | None:
    """One server of `flags` (its world size the box: one replica, the whole load) under `arrival`, in the twin."""
    target = job.target.model_copy(update={"gpus": flags.world_size})
    one = job.model_copy(update={"target": target, "arrival": arrival})
    return simulate(one, flags).summary(one)


def _probe(job: Job, flags: VllmFlags) -> LoadSummary | None:
    users = max(1, min(flags.max_num_seqs or PROBE_USERS, PROBE_USERS))
    # Long enough to run at a full batch, not only to fill it: a short probe reads the ramp up and under-states it.
    arrival = Arrival(concurrency=users, requests=max(users * 4, STEP_REQUESTS // 2), warmup_requests=users)
    return _run(job, flags, arrival)


def twin_capacity(job: Job, flags: VllmFlags, estimate: float) -> tuple[float | None, LoadSummary | None]:
    """The highest rate (req/s) at which one server of `flags` meets the job's SLOs in the twin, at most `estimate`
    (its saturated throughput: no server sustains more than a full batch serves): the estimate first, then halving
    until a step meets them, then bisection; at most TWIN_STEPS steps (or the job's max_steps where more) of the
    job's `capacity_search.requests_per_step` requests (STEP_REQUESTS where fewer)."""
    judged, search = _judged(job), job.capacity_search
    requests = max(search.requests_per_step, STEP_REQUESTS)
    lo: float | None = None
    hi: float | None = None
    best: LoadSummary | None = None
    rate: float | None = estimate
    for step in range(max(search.max_steps, TWIN_STEPS)):
        if rate is None:
            break
        arrival = Arrival(
            rate=rate,
            requests=requests,
            warmup_requests=max(1, requests // 10),
            seed=step,
        )
        summary = _run(job, flags, arrival)
        if summary is not None and all(slo.violation(summary) <= 0 for slo in judged):
            lo, best = rate, summary
        else:
            hi = rate
        rate = _next_rate(rate, lo, hi)
    return lo, best


def _next_rate(rate: float, lo: float | None, hi: float | None) -> float | None:
    if lo is not None and hi is not None:
        return None if hi - lo <= TOLERANCE * lo else (lo + hi) / 2
    return rate / 2 if lo is None else None  # the estimate met the SLOs: a server sustains no more


def _pool(job: Job, flag_sets: int) -> list[VllmFlags]:
    """`flag_sets` of the job's space, a seeded sample taken in turn from each server shape (world size) the space
    holds, so it cannot leave out the shape a card needs (a 70B model fits an L40S only at TP 4 or more)."""
    by_shape: dict[int, list[VllmFlags]] = {}
    for c in candidates(job.search_space(), flag_sets * 4, seed=0):
        by_shape.setdefault(c.flags.world_size, []).append(c.flags)
    rng = random.Random(0)
    rows = [rng.sample(by_shape[k], len(by_shape[k])) for k in sorted(by_shape)]
    taken = [row[i] for i in range(max(map(len, rows), default=0)) for row in rows if i < len(row)]
    return taken[:flag_sets]


def _servers(capacity: float, world_size: int, rate: float, headroom: float) -> tuple[int, float]:
    """(GPUs the rate needs on servers of this capacity and shape, -req/s a GPU): the smaller the better."""
    return math.ceil(rate / (capacity * headroom)) * world_size, -capacity / world_size


def best_on_card(job: Job, card: str, *, rate: float, headroom: float, flag_sets: int = FLAG_SETS) -> CardPick:
    """The twin's best flag set of the job's space on `card`: the fewest GPUs for `rate` under the SLOs (then the
    most req/s a GPU)."""
    on = on_card(job, card)
    pool = _pool(on, flag_sets)
    probed: list[tuple[float, VllmFlags]] = []
    for flags in pool:
        summary = _probe(on, flags)
        if summary is not None and summary.request_throughput > 0:
            probed.append((summary.request_throughput, flags))
    if not probed:
        return CardPick(card, None, None, None, len(pool), "no flag set started and held a load on it")
    probed.sort(key=lambda p: p[0] / p[1].world_size, reverse=True)
    found: list[tuple[float, float | None, VllmFlags]] = []
    for estimate, flags in probed[:SEARCHED]:
        capacity, summary = twin_capacity(on, flags, estimate)
        if capacity is not None:
            found.append((capacity, _tokens(summary), flags))
    if not found:
        return CardPick(card, None, None, None, len(pool), "no flag set met the SLOs at any rate tried")
    capacity, tokens, flags = min(found, key=lambda f: _servers(f[0], f[2].world_size, rate, headroom))
    return CardPick(card, flags, capacity, tokens, len(pool))


def _tokens(summary: LoadSummary | None) -> float | None:
    if summary is None or summary.requests_succeeded <= 0 or summary.completion_tokens <= 0:
        return None
    return summary.completion_tokens / summary.requests_succeeded


def compare_cards(
    job: Job,
    cards: Sequence[str],
    *,
    rate: float,
    headroom: float,
    prices: Mapping[str, tuple[float, str]],
    flag_sets: int = FLAG_SETS,
) -> list[CardPlan]:
    """Each card's plan, ranked: by $/hour where every card that can serve the load has a price, else by GPUs
    needed (then req/s a GPU); cards with no flag set that meets the SLOs last."""
    if not _judged(job):
        raise ConfigError("--compare-gpus ranks cards under the study's SLOs, and it has none")
    if job.workload.conversations is not None:
        raise ConfigError("--compare-gpus plans a request rate; a conversation workload's users send no fixed rate")
    if job.arrival.trace is not None:
        # Its steps are the job's workload at chosen rates; a trace's own lengths and times are not replayed here.
        raise ConfigError("--compare-gpus sizes the job's workload at a rate; give a job with a workload, not a trace")
    if not job.model_profile().predictable:
        raise ConfigError(f"--compare-gpus: the twin's start-up arithmetic does not know {job.target.model}")
    plans = []
    for card in cards:
        price = prices.get(card)
        pick = best_on_card(job, card, rate=rate, headroom=headroom, flag_sets=flag_sets)
        plans.append(CardPlan(pick, rate, headroom, price[0] if price else None, price[1] if price else None))
    cost = by_cost(plans)
    return sorted(plans, key=lambda p: rank_key(p, cost))


def by_cost(plans: Sequence[CardPlan]) -> bool:
    """Whether the ranking is by cost: every card that can serve the load has a price."""
    serving = [p for p in plans if p.gpus is not None]
    return bool(serving) and all(p.price is not None for p in serving)


def rank_key(p: CardPlan, cost: bool) -> tuple[float, ...]:
    if p.gpus is None:
        return (math.inf, math.inf, 0.0)
    per_gpu = (p.pick.capacity_rps or 0.0) / p.pick.world_size
    first = p.usd_per_hour if cost and p.usd_per_hour is not None else float(p.gpus)
    return (first, float(p.gpus), -per_gpu)
