"""The study's confirmation: before it ends, flag sets started again until its result stands beyond the noise.

A study measures each flag set once, and a start's figure moves between starts of the same flags (24% on a 2-core
CPU build, a few percent on a GPU): the leader may be a lucky draw, and the baseline, trial 0, is the first server
the machine starts. So, within `budget.confirm` extra starts: the baseline and the leader a second time (the
headline gain then rests on neither one draw nor the order of starts), then every flag set whose interval overlaps
the leader's, or whose SLO verdict lies within the noise of its bound ("marginal"), fewest starts first, up to
`MAX_STARTS` each. Every start is a trial of its own (`repeat_of` its flag set's first trial; also `duplicate_of`
it, so readers that list a flag set once, and the search budget, skip it) with its figures and requests kept, so a
resumed study decides from everything measured. The decision is stateless: read from the study's trials each time.

Two flag sets are started again as a pair, one right after the other (`PAIR_ATTR`), and the first of each pair
alternates (A B, then B A): a machine that drifts, each start slower than the last, moves both halves of a pair
alike, and what is left of it flips sign from one pair to the next. Two flag sets with pairs are compared by the
log-ratio of each pair (`tuner.intervals.paired_difference`); without pairs, by their starts pooled, and a flag set
started once is never called separable from another. The between-start noise is joined with the platform's prior
(`tuner.intervals.PRIORS`) so two repeats do not pass for a noise known exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.intervals import (
    NOT_SEPARABLE,
    Interval,
    Noise,
    Pooled,
    Prior,
    figure_of,
    format_with_ci,
    learn_noise,
    paired_difference,
    pool,
    relative_difference,
    run_intervals,
    scaled,
    slo_verdict,
    spotless,
)
from tuner.load import RequestRecord
from tuner.record import MEASURED, TrialRecord
from tuner.scoring import Figure, Slo
from tuner.store import flag_key
from tuner.study.objective import Objective
from tuner.study.trial import TrialLike
from tuner.study.verdict import Values

__all__ = [
    "CI_RUN_ATTR",
    "CONFIRM_ATTR",
    "MAX_STARTS",
    "NOT_SEPARABLE",
    "PAIR_ATTR",
    "REPEAT_OF",
    "Confirmation",
    "FlagSet",
    "RepeatingObjective",
    "ci_run_attr",
    "closing_lines",
    "is_repeat",
    "noise_of",
    "spent",
    "summary_attr",
]

REPEAT_OF = "repeat_of"
"""A trial's user attribute: the first trial of the flag set it starts again (a confirmation start)."""
CI_RUN_ATTR = "ci_run"
"""A measured trial's user attribute: {"level": 0.95, "<figure>": [value, low, high], ...}, the within-run interval
of each figure (output_tok_s, success_rate, ttft/tpot/e2e_p50/p95/p99_s)."""
CONFIRM_ATTR = "confirm"
"""The study's user attribute: what the confirmation decided (per flag set its starts and pooled intervals, the
noise learnt, the starts and server-seconds spent, the closing lines)."""
MAX_STARTS = 3
"""Starts of one flag set the confirmation goes to: three give a marginal SLO a majority and a between-start
spread of its own, and spread a small budget over several contenders rather than one."""
THROUGHPUT = "output_tok_s"
PAIR_ATTR = "confirm_pair"
"""A confirmation start's user attribute: "A-B-k", the k-th pair of flag sets A and B (their first trials, A < B)
started one right after the other; pair k starts A first when k is even, B first when odd."""


class RepeatingObjective(Objective):
    """The objective that launches a confirmation start again rather than answering it from the first trial."""

    def _duplicate(self, trial: TrialLike, key: str) -> Values | None:
        if trial.user_attrs.get(REPEAT_OF) is not None:
            return None
        return super()._duplicate(trial, key)


def ci_run_attr(
    records: Sequence[RequestRecord], duration_s: float, *, seed: int = 0, named: Sequence[Figure] = ()
) -> dict[str, Any]:
    """The `ci_run` attribute of a measured trial (`named`: the figures its study's SLOs name, `run_intervals`)."""
    cis = run_intervals(records, duration_s, seed=seed, named=named)
    return {"level": 0.95, **{name: [ci.value, ci.low, ci.high] for name, ci in cis.items()}}


def is_repeat(t: FrozenTrial | optuna.Trial) -> bool:
    return t.user_attrs.get(REPEAT_OF) is not None


def spent(trials: Sequence[FrozenTrial]) -> tuple[int, float]:
    """Confirmation starts made or under way (a failed one that was retried counts once, by its retry) and the
    server-seconds they took."""
    repeats = [t for t in trials if is_repeat(t) and t.state != TrialState.FAIL]
    return len(repeats), sum(float(t.user_attrs.get("server_seconds") or 0.0) for t in repeats)


@dataclass
class Start:
    number: int
    figures: dict[str, Interval]
    meets: dict[str, bool]  # SLO text -> this start met it
    pair: str | None = None  # the confirmation pair it is a half of (PAIR_ATTR)


@dataclass
class FlagSet:
    number: int  # its first trial
    params: dict[str, Any]
    baseline: bool
    starts: list[Start] = field(default_factory=list)
    throughput: Pooled | None = None
    slos: dict[str, str] = field(default_factory=dict)  # SLO text -> met / missed / marginal
    decided: dict[str, str] = field(default_factory=dict)  # SLO text -> how its marginal verdict was decided
    unmeasured: int = 0  # confirmation starts of it that measured nothing (they count against MAX_STARTS)

    @property
    def tried(self) -> int:
        return len(self.starts) + self.unmeasured

    @property
    def status(self) -> str:
        verdicts = set(self.slos.values())
        return "missed" if "missed" in verdicts else "marginal" if "marginal" in verdicts else "met"

    @property
    def label(self) -> str:
        return f"the baseline (#{self.number})" if self.baseline else f"#{self.number}"


def _start(t: FrozenTrial, record: TrialRecord) -> Start:
    raw = t.user_attrs.get(CI_RUN_ATTR)
    figures: dict[str, Interval] = {}
    if isinstance(raw, dict):
        for name, v in raw.items():
            if isinstance(v, list) and len(v) == 3:
                figures[name] = Interval(float(v[0]), float(v[1]), float(v[2]))
    # A trial from before the intervals: its recorded figures (the registry's and its SLOs', `TrialRecord.latencies`)
    # as points
    recorded = {"output_tok_s": record.output_tok_s, "success_rate": record.success_rate}
    recorded |= {f"{name}_s": value for name, value in record.latencies.items()}
    for name, value in recorded.items():
        if name not in figures and value is not None:
            figures[name] = Interval(float(value), float(value), float(value))
    if (run := figures.get(THROUGHPUT)) is not None:
        figures[THROUGHPUT] = scaled(run, _scored_tok_s(t, record, run.value))
    meets = {
        name.removeprefix("slo:"): value <= 0
        for name, value in zip(record.constraint_names or [], record.constraints or [], strict=False)
        if name.startswith("slo:")
    }
    pair = t.user_attrs.get(PAIR_ATTR)
    return Start(t.number, figures, meets, pair if isinstance(pair, str) else None)


def _scored_tok_s(t: FrozenTrial, record: TrialRecord, run_tok_s: float) -> float:
    """The start's tok/s as the study compared it: the box's (`target.gpus`: flag sets of different shapes), and a
    capacity search's rate x tokens rather than its step's own (`tuner.cost.scored_tok_s`): its first value. A cost
    trial's first value is a cost, and a trial from before the box has none: there, the run's figure on the box."""
    if t.values and t.values[0] > 0 and record.cost_gpu_hours_per_m_tokens is None:
        return float(t.values[0])
    return run_tok_s * (record.replicas or 1)


def _pair_tries(trials: Sequence[FrozenTrial]) -> dict[str, list[int]]:
    """Each confirmation pair's halves tried so far (their flag sets' first trials, in the order they started),
    whatever came of them: a half that did not start is not tried again."""
    out: dict[str, list[int]] = {}
    for t in sorted(trials, key=lambda t: t.number):
        pair = t.user_attrs.get(PAIR_ATTR)
        if isinstance(pair, str) and is_repeat(t) and t.state != TrialState.FAIL:
            out.setdefault(pair, []).append(int(t.user_attrs[REPEAT_OF]))
    return out


def _flag_sets(trials: Sequence[FrozenTrial]) -> list[FlagSet]:
    """The measured flag sets, each with every start of it (its first trial, then its confirmation starts)."""
    by_number: dict[int, FlagSet] = {}
    keys: dict[str, int] = {}
    unmeasured: list[int] = []  # first trials of confirmation starts that did not start or crashed
    for t in sorted(trials, key=lambda t: t.number):
        if t.state != TrialState.COMPLETE:
            continue
        record = TrialRecord.from_attrs(t.user_attrs)
        if record.outcome != MEASURED and is_repeat(t):
            unmeasured.append(int(t.user_attrs[REPEAT_OF]))
        if record.outcome != MEASURED or (record.is_duplicate and not is_repeat(t)):
            continue
        first = int(t.user_attrs.get(REPEAT_OF, t.number))
        key = flag_key(record.flags)
        first = keys.setdefault(key, first)  # a baseline measured twice by the search counts as one flag set
        group = by_number.setdefault(first, FlagSet(first, dict(t.params), record.baseline))
        group.baseline = group.baseline or record.baseline
        group.starts.append(_start(t, record))
    for first in unmeasured:
        if first in by_number:
            by_number[first].unmeasured += 1
    return list(by_number.values())


def _slo_key(slo: Slo) -> str | None:
    return figure_of(slo.metric)


@dataclass
class Confirmation:
    """What the study's trials say, pooled: every measured flag set with its starts, its throughput interval and
    its SLO verdicts, the noise learnt, and the leader."""

    flag_sets: list[FlagSet]
    noise: dict[str, Noise]
    slos: list[Slo]
    prior: Prior | None = None
    pair_tries: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, trials: Sequence[FrozenTrial], slos: Sequence[Slo], prior: Prior | None = None) -> Confirmation:
        """`prior`: the platform's between-start spread (`tuner.intervals.platform_prior`), joined with the one the
        study learns for throughput, the figure flag sets are compared by; the SLO figures use their learnt one."""
        groups = _flag_sets(trials)
        names = {THROUGHPUT} | {k for s in slos if (k := _slo_key(s)) is not None}
        noise = {
            name: learn_noise([[s.figures[name].value for s in g.starts if name in s.figures] for g in groups])
            for name in names
        }
        if prior is not None:
            noise[THROUGHPUT] = noise[THROUGHPUT].with_prior(prior.noise)
        c = cls(groups, noise, list(slos), prior, _pair_tries(trials))
        for g in groups:
            tput = [s.figures[THROUGHPUT] for s in g.starts if THROUGHPUT in s.figures]
            g.throughput = pool(tput, noise[THROUGHPUT]) if any(i.value > 0 for i in tput) else None
            for slo in slos:
                g.slos[str(slo)], how = c._slo_verdict(g, slo)
                if how:
                    g.decided[str(slo)] = how
        return c

    def _slo_verdict(self, g: FlagSet, slo: Slo) -> tuple[str, str]:
        """A verdict and, for a marginal one decided by repeats, how: by the pooled figure once its starts agree
        or it has `MAX_STARTS` of them. One start never decides a marginal verdict."""
        key = _slo_key(slo)
        figures = [s.figures[key] for s in g.starts if key is not None and key in s.figures]
        if key is not None and spotless(key, [f.value for f in figures]):
            return ("met" if _meets(1.0, slo) else "missed"), ""
        if key is not None and figures and any(f.value > 0 for f in figures):
            pooled = pool(figures, self.noise[key])
            verdict = slo_verdict(pooled.interval, slo.op, slo.threshold)
            met = sum(_meets(f.value, slo) for f in figures)
            agree = met in (0, len(figures))
            if verdict != "marginal" or len(figures) < 2 or (len(figures) < MAX_STARTS and not agree):
                return verdict, ""
            decided = "met" if _meets(pooled.value, slo) else "missed"
            shown = format_with_ci(pooled.value, pooled.interval.low, pooled.interval.high, _unit(key))
            return decided, f"{shown} over {len(figures)} starts, met by {met}"
        meets = [s.meets.get(str(slo), False) for s in g.starts]
        met = sum(meets)
        if len(meets) >= 2 and met * 2 != len(meets) and 0 < met < len(meets):
            return ("met" if met * 2 > len(meets) else "missed"), f"met by {met} of {len(meets)} starts"
        if 0 < met < len(meets):
            return "marginal", ""
        return ("met" if met else "missed"), ""

    @property
    def leader(self) -> FlagSet | None:
        """The highest pooled throughput among the flag sets that meet every SLO."""
        feasible = [g for g in self.flag_sets if g.status == "met" and g.throughput is not None]
        return max(feasible, key=lambda g: (_tput(g), -g.number), default=None)

    @property
    def baseline(self) -> FlagSet | None:
        return next((g for g in self.flag_sets if g.baseline), None)

    def contenders(self) -> list[FlagSet]:
        """Flag sets that meet the SLOs but cannot be told from the leader (the leader itself excluded)."""
        lead = self.leader
        if lead is None or lead.throughput is None:
            return []
        out = []
        for g in self.flag_sets:
            if g is lead or g.status != "met" or g.throughput is None:
                continue
            if not self.separable(lead, g):
                out.append(g)
        return sorted(out, key=lambda g: -_tput(g))

    def pairs(self, a: FlagSet, b: FlagSet) -> list[tuple[float, float]]:
        """The throughput of a and b in each confirmation pair of the two where both halves measured."""
        halves: dict[str, dict[int, float]] = {}
        for g in (a, b):
            for s in g.starts:
                if s.pair is not None and THROUGHPUT in s.figures and _couple(s.pair) == _sorted(a.number, b.number):
                    halves.setdefault(s.pair, {})[g.number] = s.figures[THROUGHPUT].value
        return [(h[a.number], h[b.number]) for _, h in sorted(halves.items()) if len(h) == 2]

    def difference(self, a: FlagSet, b: FlagSet) -> tuple[Interval | None, str]:
        """a / b - 1 with its interval and what it rests on: the pairs of the two where they were started one after
        the other, else every start of each pooled under the study's noise (the platform's prior among it). None:
        a side started once with no between-start noise to judge it by (a within-run interval is no interval of a
        start)."""
        pairs = self.pairs(a, b)
        noise = self.noise.get(THROUGHPUT, Noise())
        if pairs:
            n = len(pairs)
            return paired_difference(pairs, noise), f"{n} pair{'s' if n > 1 else ''} of starts, one after the other"
        if a.throughput is None or b.throughput is None:
            return None, _starts_text(a, b)
        if any(len(g.starts) < 2 and math.isinf(p.df) for g, p in ((a, a.throughput), (b, b.throughput))):
            return None, _starts_text(a, b)
        d = relative_difference(a.throughput, b.throughput)
        # Starts that read exactly alike and no spread to judge them by: no interval rather than a zero-width one
        return (d if d.high > d.low else None), _starts_text(a, b)

    def separable(self, a: FlagSet, b: FlagSet) -> bool:
        """Whether a and b differ beyond the noise: an interval of their difference that excludes zero."""
        d, _ = self.difference(a, b)
        return d is not None and not d.contains(0.0)

    def next_step(self) -> tuple[FlagSet, dict[str, Any]] | None:
        """The flag set to start again next and the attributes its start carries (its pair), or None when the
        result stands: the open pair's second half first, else a new pair of the flag set `next_start` picks and
        its partner (the leader, or the baseline for the leader), the first half alternating by pair."""
        by_number = {g.number: g for g in self.flag_sets}
        for pair, tried in self.pair_tries.items():
            a, b, _ = (int(x) for x in pair.split("-"))
            if len(tried) == 1 and (other := by_number.get(b if tried[0] == a else a)) is not None:
                return other, {PAIR_ATTR: pair}
        target = self.next_start()
        if target is None:
            return None
        partner = self._partner(target)
        if partner is None:
            return target, {}
        a, b = _sorted(target.number, partner.number)
        k = sum(_couple(p) == (a, b) for p in self.pair_tries)
        first = by_number[a if k % 2 == 0 else b]
        return first, {PAIR_ATTR: f"{a}-{b}-{k}"}

    def _partner(self, g: FlagSet) -> FlagSet | None:
        lead, base = self.leader, self.baseline
        partner = lead if g is not lead else base
        if partner is None or partner is g:
            contenders = self.contenders()
            partner = contenders[0] if contenders and contenders[0] is not g else None
        return partner

    def next_start(self) -> FlagSet | None:
        """The flag set to start again next, or None when the result stands (or every candidate has its starts)."""
        lead, base = self.leader, self.baseline
        for must in (base, lead):
            if must is not None and must.tried < 2:
                return must
        marginal = [g for g in self.flag_sets if g.status == "marginal" and self.may_lead(g)]
        pool_: list[FlagSet] = [*marginal, *self.contenders()]
        if pool_ and lead is not None:
            pool_.append(lead)
        if self._headline_in_noise():
            pool_ += [g for g in (lead, base) if g is not None]
        open_ = [g for g in pool_ if g.tried < MAX_STARTS]
        if not open_:
            return None
        return min(open_, key=lambda g: (len(g.starts), g is not lead, -_tput(g), g.number))

    def _headline_in_noise(self) -> bool:
        lead, base = self.leader, self.baseline
        if lead is None or base is None or lead is base or lead.throughput is None or base.throughput is None:
            return False
        return not self.separable(lead, base)

    def may_lead(self, g: FlagSet) -> bool:
        """Whether a marginal flag set would matter: no leader yet, or its interval reaches the leader's."""
        lead = self.leader
        if lead is None or lead.throughput is None:
            return True
        if g.throughput is None:
            return False
        return g.throughput.interval.high >= lead.throughput.interval.low


def _couple(pair: str) -> tuple[int, int]:
    """The two flag sets (first trials, lower first) a pair id names."""
    a, b, _ = pair.split("-")
    return int(a), int(b)


def _sorted(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a <= b else (b, a)


def _tput(g: FlagSet) -> float:
    return g.throughput.value if g.throughput is not None else 0.0


def _meets(value: float, slo: Slo) -> bool:
    if slo.op in ("<=", "<"):
        return value <= slo.threshold if slo.op == "<=" else value < slo.threshold
    return value >= slo.threshold if slo.op == ">=" else value > slo.threshold


def _unit(key: str) -> str:
    if key == THROUGHPUT:
        return "tok/s"
    return "fraction" if key == "success_rate" else "s"


def _pct(d: Interval) -> str:
    return f"{d.value * 100:+.1f}% ± {d.half_width * 100:.1f}%"


def _starts_text(a: FlagSet, b: FlagSet) -> str:
    if len(a.starts) == len(b.starts):
        return f"{len(a.starts)} start{'s' if len(a.starts) > 1 else ''} each"
    return f"{len(a.starts)} starts against {len(b.starts)}"


def closing_lines(c: Confirmation, *, starts_spent: int, server_seconds: float, budget: int) -> list[str]:
    """How sure the study's result is, in the words a user choosing between two flag sets needs."""
    lines: list[str] = []
    lead, base = c.leader, c.baseline
    if lead is None:
        marginal = [g.label for g in c.flag_sets if g.status == "marginal"]
        lines.append("no flag set meets every SLO beyond the noise")
        if marginal:
            lines.append(f"within the noise of an SLO bound, undecided: {', '.join(marginal)}")
    else:
        lines += _headline(c, lead, base)
        for g in c.contenders():
            if g is base:
                continue  # the headline has said it
            d, on = c.difference(lead, g)
            lines.append(
                f"{lead.label} and {g.label} are {NOT_SEPARABLE} ({_diff_text(d, lead, g, on)}): either will do"
            )
    for g in c.flag_sets:
        undecided = [slo for slo, v in g.slos.items() if v == "marginal"]
        if undecided and (lead is None or c.may_lead(g)):
            lines.append(
                f"{g.label}: {', '.join(undecided)} within the noise of its bound after {len(g.starts)} "
                f"start{'s' if len(g.starts) > 1 else ''}: undecided, not counted as met"
            )
        for slo, how in g.decided.items():
            verdict = g.slos[slo]
            lines.append(f"{g.label}: {slo} was within the noise of its bound; decided {verdict} by repeats ({how})")
    lines.append(_noise_line(c, starts_spent, server_seconds, budget))
    return lines


def _diff_text(d: Interval | None, a: FlagSet, b: FlagSet, on: str) -> str:
    """`+3.0% ± 4.1%` over the interval, or the two pooled figures' ratio where one start leaves no interval."""
    if d is not None:
        return _pct(d)
    ratio = _tput(a) / _tput(b) - 1 if _tput(b) > 0 else 0.0
    return f"{ratio * 100:+.1f}%, {on}: no interval from one start"


def _shown(g: FlagSet) -> str:
    """A flag set's tok/s pooled over its starts with its interval; one start: the figure alone, said so."""
    assert g.throughput is not None
    if len(g.starts) < 2:
        return f"{g.throughput.value:,.1f} tok/s, 1 start"
    return format_with_ci(g.throughput.value, g.throughput.interval.low, g.throughput.interval.high, "tok/s")


def _headline(c: Confirmation, lead: FlagSet, base: FlagSet | None) -> list[str]:
    assert lead.throughput is not None
    shown = _shown(lead)
    if base is None or base.throughput is None:
        return [f"{lead.label} leads with {shown} ({len(lead.starts)} starts); the baseline was not measured"]
    if lead is base:
        return [f"the baseline (#{base.number}) leads ({shown}): no flag set beats vLLM's defaults"]
    d, on = c.difference(lead, base)
    note = "" if base.status == "met" else f" (the baseline {'misses' if base.status == 'missed' else 'is marginal on'}"
    note += " its SLOs)" if note else ""
    if d is None:
        return [f"{lead.label} and the baseline are {NOT_SEPARABLE} ({_diff_text(d, lead, base, on)}){note}"]
    ci = f"95% CI {d.low * 100:+.0f}..{d.high * 100:+.0f}%, {on}"
    if not d.contains(0.0):
        return [f"{lead.label} beats the baseline by {d.value * 100:+.0f}% ({ci}){note}"]
    return [f"{lead.label} and the baseline are {NOT_SEPARABLE} ({_pct(d)}; {ci}): the gain is within the noise{note}"]


def _noise_line(c: Confirmation, starts_spent: int, server_seconds: float, budget: int) -> str:
    noise = c.noise.get(THROUGHPUT, Noise())
    if budget == 0:
        return "budget.confirm is 0: every figure is one start, no flag set separable from another"
    prior_df = c.prior.df if c.prior is not None else 0
    repeats = noise.df - prior_df
    seen = (
        f"between starts the same flags moved {noise.relative_sd:.1%} in tok/s ({repeats} repeat"
        f"{'s' if repeats != 1 else ''}"
        + (f" and the platform's prior of {c.prior.relative_sd:.0%}" if c.prior is not None else "")
        + ")"
        if noise.df
        else "no flag set was started twice: the intervals are within-run only"
    )
    return f"{seen}; confirmation: {starts_spent} of {budget} extra starts, {server_seconds / 60:.1f} server-min"


def noise_of(study_attrs: dict[str, Any], figure: str = THROUGHPUT) -> Noise:
    """The noise a study learnt for a figure, from its `confirm` attribute (none: a study from before it)."""
    summary = study_attrs.get(CONFIRM_ATTR)
    raw = summary.get("noise", {}).get(figure) if isinstance(summary, dict) else None
    if not isinstance(raw, dict):
        return Noise()
    try:
        return Noise(float(raw["log_var"]), int(raw["df"]))
    except (KeyError, TypeError, ValueError):
        return Noise()


def _beats_baseline(c: Confirmation) -> bool | None:
    lead, base = c.leader, c.baseline
    if lead is None or base is None or lead is base:
        return None
    return c.separable(lead, base)


def _paired_attr(c: Confirmation) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, a in enumerate(c.flag_sets):
        for b in c.flag_sets[i + 1 :]:
            pairs = c.pairs(a, b)
            d, _ = c.difference(a, b)
            if pairs and d is not None:
                out[f"{a.number}-{b.number}"] = {"pairs": len(pairs), "difference": [d.value, d.low, d.high]}
    return out


def summary_attr(c: Confirmation, lines: list[str], *, starts_spent: int, server_seconds: float) -> dict[str, Any]:
    """The study's `confirm` attribute: JSON, read by the morning commands."""

    def interval(p: Pooled | None) -> list[float] | None:
        return None if p is None else [p.value, p.interval.low, p.interval.high]

    lead = c.leader
    return {
        "level": 0.95,
        "leader": lead.number if lead is not None else None,
        "starts_spent": starts_spent,
        "server_seconds": round(server_seconds, 3),
        # Per figure: the between-start variance of its log and its degrees of freedom (`tuner verify` reads it).
        "noise": {k: {"log_var": n.log_var, "df": n.df, "relative_sd": n.relative_sd} for k, n in c.noise.items()},
        # The platform's prior joined into the throughput noise above, and where its figure comes from.
        "prior": None
        if c.prior is None
        else {"relative_sd": c.prior.relative_sd, "df": c.prior.df, "source": c.prior.source},
        # Per pair of flag sets compared by their pairs of starts: the paired interval of a / b - 1.
        "paired": _paired_attr(c),
        # The flag sets that meet the SLOs but cannot be told from the leader (the front marks them), and whether
        # the leader was told from the baseline.
        "not_separable": [g.number for g in c.contenders()],
        "beats_baseline": _beats_baseline(c),
        "flag_sets": {
            str(g.number): {
                "starts": [s.number for s in g.starts],
                "output_tok_s": interval(g.throughput),
                "slos": dict(g.slos),
                "status": g.status,
            }
            for g in c.flag_sets
        },
        "lines": lines,
    }
