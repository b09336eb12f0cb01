"""The closing line's caveat: the winner and the baseline measured under different contention (one beside busy
processes, one on a quiet machine, or an emulator that lagged under one of them) compare the machine as much as
the flags, so the study says so beside its verdict."""

from __future__ import annotations

from collections.abc import Sequence

from optuna.trial import FrozenTrial

from tuner.load.contention import Contention, contention_warning, pooled
from tuner.record import TrialRecord
from tuner.study.confirm import Confirmation

__all__ = ["compared_under", "contention_lines"]


def contention_lines(trials: Sequence[FrozenTrial], c: Confirmation) -> list[str]:
    """The closing lines' caveat for the leader against the baseline, if they were measured under different
    contention (none otherwise)."""
    lead, base = c.leader, c.baseline
    if lead is None or base is None:
        return []
    line = compared_under(
        trials, (lead.label, [s.number for s in lead.starts]), (base.label, [s.number for s in base.starts])
    )
    return [line] if line is not None else []


def compared_under(
    trials: Sequence[FrozenTrial], lead: tuple[str, list[int]], base: tuple[str, list[int]]
) -> str | None:
    """A line when the leader's starts and the baseline's (label, trial numbers) were taken under different
    contention; None when alike, unknown, or the leader is the baseline."""
    if lead[1] == base[1]:
        return None
    by_number = {t.number: t for t in trials}

    def of(numbers: list[int]) -> Contention | None:
        return pooled(
            [
                Contention.of(TrialRecord.from_attrs(by_number[n].user_attrs).contention)
                for n in numbers
                if n in by_number
            ]
        )

    warning = contention_warning(of(lead[1]), of(base[1]), lead[0], base[0])
    if warning is None:
        return None
    return f"{lead[0]} against the baseline: {warning}; not decided on these figures alone: `tuner verify` re-tests it"
