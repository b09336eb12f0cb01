"""What the machine was doing during a load phase, and what that means for the figures taken there.

A trial's figures hold only for the machine they were measured on, as it was: other processes that took CPU from
the server or the load client, a hypervisor that took it from the whole VM (steal), and, for the emulator, an engine
that fell behind the virtual clock its `time_scale` promises (its lag: emulated seconds of the run that never
happened, so it served fewer tokens in the time the client measured). Pure: the readings come from
`tuner.load.host_contention`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, ValidationError

from tuner.errors import ConfigError

__all__ = [
    "BUSY_CORES",
    "LAG_SHARE_LIMIT",
    "Contention",
    "contention_warning",
    "holdable_time_scale",
    "lag_share",
    "lag_share_limit",
    "pooled",
]

LAG_SHARE_LIMIT: Final = 0.05
"""An emulator run whose engine lost more than this share of the measured duration is lagged: measured again."""

LAG_LIMIT_ENV: Final = "TUNER_EMULATOR_LAG_LIMIT"


def lag_share_limit() -> float:
    """LAG_SHARE_LIMIT, or the share TUNER_EMULATOR_LAG_LIMIT gives: a rehearsal on a machine known to be busy (a
    laptop, a test suite beside other work) may accept more lag rather than stop; the lag is still recorded."""
    text = os.environ.get(LAG_LIMIT_ENV)
    if not text:
        return LAG_SHARE_LIMIT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise ConfigError(f"{LAG_LIMIT_ENV}={text!r}: give a share of the run between 0 and 1, e.g. 0.05")
    return value


BUSY_CORES: Final = 0.5
"""Other processes' average CPU use (cores) from which two runs count as taken under different contention."""

_STEAL_APART: Final = 0.05  # steal shares further apart than this: the hypervisor treated the two runs differently


class Contention(BaseModel):
    """One load phase's surroundings. None: not known (not measured, or no /proc here)."""

    model_config = ConfigDict(extra="ignore")

    seconds: float | None = None  # wall seconds the load phase took
    cpus: int | None = None  # the host's CPUs, as the kernel counts them
    load_before: float | None = None  # the 1-minute load average as the phase began
    load_after: float | None = None  # ... and as it ended
    other_cores: float | None = None  # CPU other processes than the study's own tree used, in cores, on average
    steal: float | None = None  # the share of CPU time the hypervisor gave to other guests (0 on bare metal)
    time_scale: float | None = None  # the server's emulated seconds per wall second (1: real time)
    emulator_lag_s: float | None = None  # emulated seconds the emulator's engine slipped behind its clock
    emulator_lag_share: float | None = None  # of the measured duration (emulated seconds)
    lagged: bool = False  # the lag passed LAG_SHARE_LIMIT in every run of the trial
    measured_again: int = 0  # runs of the load phase discarded because the emulator lagged

    @classmethod
    def of(cls, attr: Any) -> Contention | None:
        """A record's stored `contention` attribute read back (None: absent or unreadable)."""
        if not isinstance(attr, dict):
            return None
        try:
            return cls.model_validate(attr)
        except ValidationError:
            return None

    def describe(self) -> str:
        """One line for a person: 'other processes 1.9 of 2 cores, load 2.4 -> 3.1, steal 0%, emulator lag 3%'."""
        parts = []
        if self.other_cores is not None:
            of = f" of {self.cpus}" if self.cpus else ""
            parts.append(f"other processes {self.other_cores:.1f}{of} cores")
        if self.load_before is not None and self.load_after is not None:
            parts.append(f"load {self.load_before:.1f} -> {self.load_after:.1f}")
        if self.steal is not None:
            parts.append(f"steal {self.steal:.0%}")
        if self.emulator_lag_share is not None:
            parts.append(f"emulator lag {self.emulator_lag_share:.1%} of the run")
        if self.lagged:
            parts.append("LAGGED (its figures understate the flags)")
        if self.measured_again:
            parts.append(f"measured again {self.measured_again}x for lag")
        return ", ".join(parts) if parts else "not recorded"


def lag_share(lag_s: float | None, duration_s: float | None) -> float | None:
    """The emulator's lost virtual time as a share of the measured duration (both emulated seconds)."""
    if lag_s is None or not duration_s or duration_s <= 0:
        return None
    return max(0.0, lag_s) / duration_s


def holdable_time_scale(time_scale: float, share: float) -> float:
    """The time_scale this machine can hold, from a run at `time_scale` whose engine lost `share` of its duration:
    it delivered (1 - share) of the promised virtual time, so it ran at time_scale x (1 - share); a fifth below
    that, so a quieter moment's measurement does not sit at the edge; rounded down to two significant figures."""
    # A run that lost nearly all of its time says little about the rate it can hold: read as 95% lost at worst.
    achieved = time_scale * (1.0 - min(max(share, 0.0), 0.95)) * 0.8
    digits = 10.0 ** (math.floor(math.log10(achieved)) - 1)
    return round(max(digits, math.floor(achieved / digits + 1e-9) * digits), 6)


def contention_warning(a: Contention | None, b: Contention | None, a_label: str, b_label: str) -> str | None:
    """A note when `a` and `b` were taken under different contention (one lagged, other processes' CPU or steal
    apart); None when they were alike or either is unknown."""
    if a is None or b is None:
        return None
    why = []
    if a.lagged or b.lagged:
        lagged = " and ".join(label for c, label in ((a, a_label), (b, b_label)) if c.lagged)
        why.append(f"the emulator lagged behind its clock under {lagged}")
    if a.other_cores is not None and b.other_cores is not None and abs(a.other_cores - b.other_cores) >= BUSY_CORES:
        why.append(
            f"other processes used {a.other_cores:.1f} cores beside {a_label} and {b.other_cores:.1f} beside {b_label}"
        )
    if a.steal is not None and b.steal is not None and abs(a.steal - b.steal) >= _STEAL_APART:
        why.append(f"steal {a.steal:.0%} under {a_label}, {b.steal:.0%} under {b_label}")
    if not why:
        return None
    return "measured under different contention: " + "; ".join(why) + " (the comparison may be the machine's)"


def pooled(contentions: list[Contention | None]) -> Contention | None:
    """Several starts' contention as one: other processes' CPU and steal averaged, lagged if any start lagged, the
    largest lag share (None: no start recorded any)."""
    known = [c for c in contentions if c is not None]
    if not known:
        return None

    def mean(values: list[float | None]) -> float | None:
        vs = [v for v in values if v is not None]
        return sum(vs) / len(vs) if vs else None

    shares = [c.emulator_lag_share for c in known if c.emulator_lag_share is not None]
    return Contention(
        cpus=known[0].cpus,
        other_cores=mean([c.other_cores for c in known]),
        steal=mean([c.steal for c in known]),
        emulator_lag_share=max(shares) if shares else None,
        lagged=any(c.lagged for c in known),
        time_scale=known[0].time_scale,
    )
