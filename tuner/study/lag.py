"""The study stops where the machine cannot hold the emulator's time_scale: a trial that lagged in every run of its
load phase (`tuner.study.measure.measure_watched`) would only be followed by more figures the machine made up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tuner.errors import TunerError
from tuner.load.contention import Contention, holdable_time_scale, lag_share_limit
from tuner.record import TrialRecord

__all__ = ["TimeScaleNotHeld", "stop_if_lagged"]


class TimeScaleNotHeld(TunerError):
    """The emulator fell behind its clock in every run of a trial: the job's time_scale is too fast for this host."""


def stop_if_lagged(number: int, attrs: dict[str, Any], on_event: Callable[[str], None] | None = None) -> None:
    """Raises TimeScaleNotHeld, with the time_scale the machine can hold, when trial `number` stayed lagged; says
    so (`on_event`) when it was measured again for lag and then kept."""
    record = TrialRecord.from_attrs(attrs)
    if record.is_duplicate and not record.is_repeat:
        return  # a sampler's repeat measured nothing: its copy of the original's record was said with it
    c = Contention.of(record.contention)
    if c is not None and c.measured_again and not c.lagged and on_event is not None:
        on_event(
            f"trial {number}: the emulator fell behind its clock in {c.measured_again} run"
            f"{'s' if c.measured_again > 1 else ''}, measured again: kept the run on time "
            f"(lag {c.emulator_lag_share or 0.0:.1%})"
        )
    if c is None or not c.lagged or c.emulator_lag_share is None:
        return
    scale = c.time_scale or 1.0
    runs = c.measured_again + 1
    raise TimeScaleNotHeld(
        f"this machine cannot hold time_scale {scale:g}: the emulator fell {c.emulator_lag_share:.0%} behind its "
        f"clock (limit {lag_share_limit():.0%}) in all {runs} runs of trial {number}; it can hold about time_scale "
        f"{holdable_time_scale(scale, c.emulator_lag_share):g} (target.emulator.time_scale in a new study), "
        "or run it on a quieter machine"
    )
