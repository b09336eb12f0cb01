"""Where a real server died under load that the twin did not foresee: a learned region of risk around it.

A crash the twin's memory arithmetic cannot explain (its simulation foresaw none, and a start with no more memory to
spare held its load, or there is no fullest batch to judge; a crash the refit's runtime headroom explains is the
headroom's) says that something outside its model kills the server near that flag set: a kernel that fails at
some batch shape, a driver limit, a region of the space. Until more trials say where the region ends, flag sets
near the crashed one share its fate, by a halo in the flags' places along their ranges
(tuner.twin.residual.flag_positions). Per flag: the same value is inside; along an ordered flag a value further
toward more load (a higher value: more sequences, more tokens a step, more memory held) stays inside for longer
(HALO_UP) than one toward less (HALO_DOWN); and whatever the distance, a flag may not bound the region at all (FREE:
a region is a box along one or two flags, not a ball). A flag set's halo is the product over its flags, its risk
the largest halo of any crash. Two crashes that differ in one flag only show that flag does not bound the region:
it is left out of every halo.

A start that held its load shelters the flag sets near it (within HALO_DOWN either way: a crash region need not
start at the top of a range): the risk is shrunk by the strongest shelter, so a survivor beside a crash bounds the
region there. The twin multiplies its chance of meeting the SLOs by one less the risk, so the next proposals
avoid the neighbourhood unless nothing else can win.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

from tuner.twin.residual import Position

__all__ = ["FREE", "HALO_DOWN", "HALO_UP", "crash_risk", "halo", "unbounding"]

HALO_UP = 0.8  # toward more load: a value this far (a fraction of the flag's range) keeps 60% of the bounded risk
HALO_DOWN = 0.35  # toward less load the risk fades faster; a survivor's shelter reaches this far either way
FREE = 0.3  # the chance a flag does not bound the region: a value however far keeps this much of a crash's risk
OTHER_VALUE = 0.5  # another value of an unordered flag (a choice of names), were the flag bounding


def halo(
    at: Mapping[str, Position],
    centre: Mapping[str, Position],
    up: float,
    down: float,
    free: float = 0.0,
    skip: AbstractSet[str] = frozenset(),
) -> float:
    """How far inside the halo of `centre` the flag set `at` lies (1: every flag at its value), with `up` the reach
    toward more load, `down` toward less, `free` the share a flag keeps however far, `skip` flags left out."""
    share = 1.0
    for name, x in at.items():
        y = centre.get(name)
        if y is None or x == y or name in skip:
            continue
        if isinstance(x, float) and isinstance(y, float):
            near = math.exp(-0.5 * ((x - y) / (up if x > y else down)) ** 2)
        else:
            near = OTHER_VALUE
        share *= free + (1.0 - free) * near
    return share


def unbounding(crashed: Sequence[Mapping[str, Position]]) -> set[str]:
    """The flags two crashes differ in alone: the region holds both values, so the flag does not bound it."""
    out: set[str] = set()
    for i, a in enumerate(crashed):
        for b in crashed[i + 1 :]:
            differ = [name for name in a if a[name] != b.get(name)]
            if len(differ) == 1:
                out.add(differ[0])
    return out


def crash_risk(
    at: Mapping[str, Position], crashed: Sequence[Mapping[str, Position]], held: Sequence[Mapping[str, Position]]
) -> float:
    """The chance that a start of `at` dies under load, from the crashes the twin did not foresee (`crashed`) and
    the starts that held their load (`held`): the largest crash halo, shrunk by the strongest shelter (a survivor's
    near halo, alike both ways)."""
    if not crashed:
        return 0.0
    skip = unbounding(crashed)
    risk = max(halo(at, c, HALO_UP, HALO_DOWN, FREE, skip) for c in crashed)
    shelter = max((halo(at, s, HALO_DOWN, HALO_DOWN) for s in held), default=0.0)
    return risk * (1.0 - shelter)
