"""A study and its trials as the morning commands read them: Optuna's public API in, plain values out.

Each trial is read from its Optuna state, values, constraints and the user attributes the study writes (the
contract in docs: "flags", "outcome", "reason", "output_tok_s", ...), so anything that opens the storage, from
`optuna.load_study` to optuna-dashboard, sees the same facts.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.errors import ConfigError
from tuner.intervals import Interval, format_with_ci, learn_noise, pool, scaled
from tuner.record import MEASURED, StoredJob, StudyRecord, TrialRecord
from tuner.scoring import (
    OBJECTIVE_FALLBACK,
    Figure,
    Slo,
    figures,
    headline_figures,
    in_table_order,
    named_figures,
    parse_slo,
    study_figures,
)

__all__ = ["StudyView", "TrialView", "first_label", "pooled_over_starts", "study_view", "trial_view"]


@dataclass(frozen=True)
class TrialView:
    number: int
    state: str  # Optuna's: COMPLETE, FAIL, RUNNING, PRUNED, WAITING
    baseline: bool
    outcome: str | None
    reason: str | None
    flags: dict[str, Any]
    throughput: float | None  # first objective: output tok/s (or the max SLO-meeting rate's)
    objective_latency_s: float | None  # second objective: the study's `latency_metric` (e2e_p95, ttft_p99, ...)
    output_tok_s: float | None = None
    request_rate: float | None = None
    success_rate: float | None = None
    latencies: Mapping[str, float] = field(default_factory=dict)  # the registry's figures by name, in seconds
    goodput: float | None = None
    good_share: float | None = None  # the share of its requests that met every latency SLO on their own
    diagnosis: str | None = None
    kv_tokens: int | None = None
    predicted_kv_tokens: int | None = None
    twin_predicted_tok_s: float | None = None  # the twin sampler's prediction before the trial ran
    twin_verdict_missed: str | None = None  # the SLO verdict the twin got wrong for it, said in a line
    vllm_version: str | None = None  # the server's, from its start-up facts (None: not logged, or an older study)
    slo_stop: str | None = None  # the load stopped at a certain SLO miss: its figures cover part of the run
    feasible: bool = False
    constraints: tuple[float, ...] = ()
    constraint_names: tuple[str, ...] = ()
    violated: tuple[str, ...] = ()
    duplicate_of: int | None = None
    notes: tuple[str, ...] = ()  # the study's repairs of the sampled flags (vLLM's rules) and its warnings
    server_seconds: float = 0.0
    latency_metric: str | None = None
    started: dt.datetime | None = None
    completed: dt.datetime | None = None
    # Output tok/s with its 95% interval (value, low, high) and the starts it pools: the confirmation's over every
    # start of the flag set where it ran (the study's `confirm`), else the run's own over its requests (`ci_run`)
    throughput_ci: tuple[float, float, float] | None = None
    starts: int = 1
    # A confirmation start: the first trial of the flag set it started again (its figures pool into that one's row)
    repeat_of: int | None = None
    # The run's own figures with their within-run intervals, by the record's names (`output_tok_s`, `ttft_p95_s`)
    run_intervals: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    # The whole box (`target.gpus`): `throughput` is the box's, `output_tok_s` and `request_rate` one replica's.
    replicas: int | None = None
    box_gpus: int | None = None
    box_request_rate: float | None = None
    tok_s_per_gpu: float | None = None
    usd_per_m_tokens: float | None = None
    gpu_hours_per_m_requests: float | None = None
    # The cost objective (tuner.cost): `throughput` is million output tokens per $ (per GPU-hour without a price)
    # at the job's load, `replicas` x the shape's GPUs (`box_gpus`) the box that load needs.
    box_output_tok_s: float | None = None  # the box's output tok/s as the record has it (`throughput`, but for cost)
    cost_load_rate: float | None = None
    cost_usd_per_hour: float | None = None
    cost_usd_per_m_tokens: float | None = None
    cost_gpu_hours_per_m_tokens: float | None = None
    # What the machine was doing during its load phase (tuner.load.contention.Contention as stored; None: not kept)
    contention: Mapping[str, Any] | None = None

    @property
    def costed(self) -> bool:
        """Scored by the cost objective: the first value is the inverse of what serving the job's load costs."""
        return self.cost_gpu_hours_per_m_tokens is not None

    @property
    def cost_text(self) -> str:
        """`$1.23` per million output tokens at the job's load, or `4.56 GPU-h` without a price; `—` unscored."""
        if self.cost_usd_per_m_tokens is not None:
            return f"${self.cost_usd_per_m_tokens:,.2f}"
        return fmt_or_dash(self.cost_gpu_hours_per_m_tokens, ",.2f", " GPU-h")

    @property
    def throughput_text(self) -> str:
        """`312 ± 9` where the interval is known, the bare figure where not; `—` for no measurement; a cost study's
        trial: its cost per million output tokens (`cost_text`)."""
        if self.costed:
            return self.cost_text
        if self.throughput_ci is None:
            return "—" if self.throughput is None else f"{self.throughput:,.1f}"
        return format_with_ci(*self.throughput_ci, "")

    @property
    def measured(self) -> bool:
        """A load phase ran and produced both objective values."""
        return self.outcome == MEASURED and self.throughput is not None and self.objective_latency_s is not None

    def latency(self, name: str) -> float | None:
        """A figure by name (`ttft_p95`), in seconds; None when not recorded."""
        return self.latencies.get(name)

    @property
    def verdict(self) -> str:
        """One phrase: ok, which SLOs it missed, or why it has no measurement."""
        if self.state == "RUNNING":
            return "running"
        if self.state == "WAITING":
            return "waiting"
        if self.repeat_of is not None and self.measured:
            return f"#{self.repeat_of} started again"
        if self.duplicate_of is not None and self.repeat_of is None:
            return f"duplicate of #{self.duplicate_of}"
        if self.measured:
            # Figures the emulator could not keep its clock for understate the flags: said wherever the verdict is.
            lagged = " (emulator lagged)" if self.contention and self.contention.get("lagged") is True else ""
            if self.feasible:
                return "ok" + lagged
            return ("misses " + ", ".join(self.violated) if self.violated else "misses SLOs") + lagged
        label = {
            "launch_failed": "launch failed",
            "crashed": "crashed",
            "skipped_infeasible": "skipped",
            "interrupted": "interrupted",
            "workload_invalid": "workload refused",
        }.get(self.outcome or "", (self.outcome or self.state).lower())
        return f"{label}: {self.reason}" if self.reason and self.reason != self.outcome else label

    def as_dict(self, shown: Sequence[Figure] = ()) -> dict[str, Any]:
        """The trial as the CSV/JSON write it: flat, each figure under its stored name (`ttft_p95_s`): the
        registry's and `shown` (its study's, `StudyView.figures`; null where not measured), and any other it
        recorded."""
        d: dict[str, Any] = {}
        for k in self.__dataclass_fields__:
            if k == "latencies":
                d |= {f.attr: self.latency(f.name) for f in (*figures(), *shown)}
                d |= {f"{name}_s": value for name, value in self.latencies.items()}
                continue
            d[k] = getattr(self, k)
            if k == "objective_latency_s":
                # The name tuner 0.1 gave it, whatever its statistic: scripts read it.
                d["latency_p95_s"] = self.objective_latency_s
        d["constraints"] = dict(zip(self.constraint_names, self.constraints, strict=True))
        del d["constraint_names"]
        d["run_intervals"] = {k: list(v) for k, v in self.run_intervals.items()}
        d["violated"] = list(self.violated)
        d["notes"] = list(self.notes)
        d["verdict"] = self.verdict
        for k in ("started", "completed"):
            d[k] = d[k].isoformat(timespec="seconds") if d[k] else None
        return d


@dataclass(frozen=True)
class StudyView:
    name: str
    attrs: dict[str, Any]
    trials: list[TrialView] = field(default_factory=list)

    @property
    def record(self) -> StudyRecord:
        """The study's own attributes, typed (what tuner wrote when it created and ran the study)."""
        return StudyRecord.from_attrs(self.attrs)

    @property
    def slos(self) -> list[str]:
        return self.record.slos

    @property
    def budget(self) -> int | None:
        return self.record.n_trials

    @property
    def job(self) -> StoredJob:
        """The job stored with the study, as far as it reads (nothing of it for a study written by hand)."""
        return StoredJob.of(self.attrs)

    @property
    def is_cost(self) -> bool:
        """A study of the cost objective: its trials' first value is million output tokens per $ (or GPU-hour)."""
        return self.record.objective == "cost"

    @property
    def priced(self) -> bool:
        """Some trial carries a $ per million output tokens (the study had a GPU-hour price)."""
        return any(t.usd_per_m_tokens is not None for t in self.trials)

    @property
    def baseline(self) -> TrialView | None:
        """The baseline as the search measured it: an interrupted or refused start of it is not it, its run again
        is (the first baseline trial where none measured)."""
        own = [t for t in self.trials if t.baseline and t.repeat_of is None]
        return next((t for t in own if t.measured), next(iter(own), None))

    @property
    def latency_metric(self) -> str:
        """The latency minimised beside throughput: as the job chose it, else its first latency SLO, else the
        registry's fallback (e2e_p95)."""
        chosen = self.record.latency_metric or self.job.latency_metric
        chosen = chosen or next((t.latency_metric for t in self.trials if t.latency_metric), None)
        if isinstance(chosen, str) and chosen:
            return chosen
        for text in self.slos:
            slo = _parsed(text)
            if slo is not None and slo.is_latency:
                return slo.metric
        return OBJECTIVE_FALLBACK

    @property
    def objective_stat(self) -> str:
        """The minimised latency's statistic as a column names it: `P95` for e2e_p95, `P90` for a ttft_p90."""
        figure = Figure.named(self.latency_metric)
        return figure.stat.upper() if figure is not None else "latency"

    @property
    def named_figures(self) -> list[Figure]:
        """The figures the study's SLOs and objective name (`ttft_p90<=60s`: TTFT P90), in table order: the ones its
        verdicts were made on, so every table shows them."""
        return in_table_order(named_figures(self._figure_names))

    @property
    def headline_figures(self) -> list[Figure]:
        """The named figures and the registry's headline ones, in table order: what a wide table or a line shows."""
        return headline_figures(self._figure_names)

    @property
    def figures(self) -> list[Figure]:
        """Every figure the study records, the named ones first, then the registry's: the CSV/JSON's."""
        return list(study_figures(self._figure_names))

    @property
    def _figure_names(self) -> list[str]:
        return [*(slo.metric for text in self.slos if (slo := _parsed(text)) is not None), self.latency_metric]

    @property
    def stopped(self) -> str | None:
        """Why the study's last run stopped before its budget when the server refused its workload (the run's
        one-line message, "the workload is invalid for this server: ..."); None otherwise."""
        stopped = self.record.stopped
        message = stopped.get("message") if stopped is not None else None
        return str(message) if message else None

    @property
    def twin_fallback(self) -> str | None:
        """Where the twin sampler handed over to TPE (its `twin_fallback` study attribute), said in a line."""
        handed = self.record.twin_fallback
        if handed is None:
            return None
        return f"after {handed.get('after')} real trials: {handed.get('why')}"

    def trial(self, number: int) -> TrialView | None:
        return next((t for t in self.trials if t.number == number), None)

    @property
    def search_trials(self) -> list[TrialView]:
        """The search's own trials: every trial but the confirmation's starts of a flag set again."""
        return [t for t in self.trials if t.repeat_of is None]

    @property
    def confirmation_starts(self) -> list[TrialView]:
        """The confirmation's starts (`tuner.study.confirm`): flag sets the search had tried, started again."""
        return [t for t in self.trials if t.repeat_of is not None]

    def starts_of(self, number: int) -> list[TrialView]:
        """Every trial that measured trial `number`'s flag set: its first trial, then its confirmation starts."""
        t = self.trial(number)
        first = number if t is None or t.repeat_of is None else t.repeat_of
        return [x for x in self.trials if x.number == first or x.repeat_of == first]


def study_view(study: optuna.Study) -> StudyView:
    attrs = dict(study.user_attrs)
    record = StudyRecord.from_attrs(attrs)
    views = [trial_view(t, record.slos) for t in study.get_trials(deepcopy=False)]
    pooled = _pooled_starts(views) | _pooled(record.confirm)
    trials = [_with_interval(t, pooled) for t in views]
    return StudyView(name=study.study_name, attrs=attrs, trials=trials)


def pooled_over_starts(views: Sequence[TrialView]) -> list[TrialView]:
    """`views` with each flag set started again at its figure pooled over its starts, from the views' own runs (for
    views re-judged after the study, as `tuner rescore` does; a stored confirmation's pooling is the study's)."""
    pooled = _pooled_starts(views)
    return [_with_interval(t, pooled) if t.number in pooled else t for t in views]


def _pooled_starts(views: Sequence[TrialView]) -> dict[int, tuple[tuple[float, float, float], int]]:
    """Per flag set started again: its tok/s pooled over its starts, as the confirmation pools it (for a study
    whose confirmation has not written its `confirm` attribute yet, which then takes over)."""
    groups: dict[int, list[Interval]] = {}
    for t in views:
        if t.measured and t.output_tok_s is not None and (t.duplicate_of is None or t.repeat_of is not None):
            run = Interval(*(t.run_intervals.get("output_tok_s") or (t.output_tok_s,) * 3))
            # at the figure the start was scored by, as the confirmation pools it: the box's, a capacity search's
            # rate x tokens (its first value; a cost trial's is a cost, so its run's figure on the box)
            scored = t.throughput if t.throughput and not t.costed else run.value * (t.replicas or 1)
            groups.setdefault(t.repeat_of if t.repeat_of is not None else t.number, []).append(scaled(run, scored))
    noise = learn_noise([[i.value for i in g] for g in groups.values()])
    out = {}
    for first, starts in groups.items():
        if len(starts) > 1 and any(i.value > 0 for i in starts):
            ci = pool(starts, noise).interval
            out[first] = ((ci.value, ci.low, ci.high), len(starts))
    return out


def _pooled(confirm: Any) -> dict[int, tuple[tuple[float, float, float], int]]:
    """Per first trial of a flag set the confirmation started again: its pooled tok/s interval and its starts."""
    out: dict[int, tuple[tuple[float, float, float], int]] = {}
    sets = confirm.get("flag_sets") if isinstance(confirm, dict) else None
    for number, g in (sets or {}).items() if isinstance(sets, dict) else ():
        ci, starts = (g.get("output_tok_s"), g.get("starts")) if isinstance(g, dict) else (None, None)
        if _triple(ci) is not None and isinstance(starts, list) and str(number).isdigit():
            out[int(number)] = (_triple(ci), len(starts))  # type: ignore[assignment]
    return out


def _with_interval(view: TrialView, pooled: Mapping[int, Any]) -> TrialView:
    if view.costed:
        return view  # its first value is a cost, not the tok/s the intervals are of
    if view.number in pooled and pooled[view.number][1] > 1:
        ci, starts = pooled[view.number]
        # The flag set's figure is its starts' pooled one: the front, the picks and the ratio to the baseline then
        # rest on every start measured, not on whichever came first.
        return replace(view, throughput=ci[0], throughput_ci=ci, starts=starts)
    ci = view.run_intervals.get("output_tok_s") if view.measured else None
    if ci is not None and view.replicas and view.replicas > 1:
        # The run's interval is the replica's; the trial's throughput is the box's (`target.gpus`).
        ci = (ci[0] * view.replicas, ci[1] * view.replicas, ci[2] * view.replicas)
    return view if ci is None else replace(view, throughput_ci=ci)


def _opt_text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _triple(v: Any) -> tuple[float, float, float] | None:
    if isinstance(v, list) and len(v) == 3 and all(isinstance(x, int | float) for x in v):
        return (float(v[0]), float(v[1]), float(v[2]))
    return None


def trial_view(trial: FrozenTrial, slos: Sequence[str] = ()) -> TrialView:
    r = TrialRecord.from_attrs(trial.user_attrs)
    values = trial.values if trial.state == TrialState.COMPLETE else None
    outcome = r.outcome
    if outcome is None and values is not None:
        outcome = MEASURED  # a study written by hand, or by an older tuner: its values are its measurement
    names, constraints = _constraints(trial, r, slos)
    violated = tuple(n for n, c in zip(names, constraints, strict=True) if c > 0)
    feasible = (
        outcome == MEASURED and values is not None and all(c <= 0 for c in constraints) and r.feasible is not False
    )
    return TrialView(
        number=trial.number,
        state=trial.state.name,
        baseline=r.baseline,
        outcome=outcome,
        reason=r.reason,
        flags=r.flags
        if "flags" in trial.user_attrs and isinstance(trial.user_attrs["flags"], dict)
        else dict(trial.params),
        throughput=_float(values[0]) if values else r.output_tok_s,
        objective_latency_s=_float(values[1])
        if values and len(values) > 1
        else r.latencies.get(r.latency_metric or OBJECTIVE_FALLBACK),
        output_tok_s=r.output_tok_s,
        request_rate=r.request_rate,
        success_rate=r.success_rate,
        latencies=r.latencies,
        goodput=r.goodput,
        good_share=r.good_share,
        diagnosis=r.diagnosis,
        slo_stop=r.slo_stop,
        kv_tokens=r.kv_tokens,
        predicted_kv_tokens=r.predicted_kv_tokens,
        twin_predicted_tok_s=r.twin_predicted_tok_s,
        twin_verdict_missed=_opt_text(trial.user_attrs.get("twin_verdict_missed")),
        vllm_version=r.vllm_version,
        feasible=feasible,
        constraints=constraints,
        constraint_names=names,
        violated=violated if outcome == MEASURED else (),
        duplicate_of=r.duplicate_of,
        repeat_of=r.repeat_of,
        run_intervals=r.intervals(),
        notes=(*r.repairs, *r.warnings),
        server_seconds=r.server_seconds or 0.0,
        latency_metric=r.latency_metric,
        started=trial.datetime_start,
        completed=trial.datetime_complete,
        contention=r.contention,
        **_box_and_cost(r),
    )


# The record's box (tuner.box) and cost (tuner.cost) figures, under the same names in the view.
_BOX_AND_COST = (
    "replicas",
    "box_gpus",
    "box_request_rate",
    "tok_s_per_gpu",
    "usd_per_m_tokens",
    "gpu_hours_per_m_requests",
    "box_output_tok_s",
    "cost_load_rate",
    "cost_usd_per_hour",
    "cost_usd_per_m_tokens",
    "cost_gpu_hours_per_m_tokens",
)


def _box_and_cost(r: TrialRecord) -> dict[str, Any]:
    return {name: getattr(r, name) for name in _BOX_AND_COST}


def _constraints(trial: FrozenTrial, r: TrialRecord, slos: Sequence[str]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """(names, values): Optuna's own constraints (what best_trials and plot_pareto_front honour), named as the
    study names them ("startup", "slo:e2e_p95<=5s"), in the order the study listed them; else the user attribute."""
    listed, listed_names = r.constraints, r.constraint_names
    own = trial.constraints
    if listed_names is not None and own and all(n in own for n in listed_names):
        keys: list[str] = [str(n) for n in listed_names]
        return tuple(_constraint_name(k, slos) for k in keys), tuple(float(own[k]) for k in keys)
    if own:
        keys = sorted(own, key=_constraint_order)
        return tuple(_constraint_name(k, slos) for k in keys), tuple(float(own[k]) for k in keys)
    if listed is not None:
        values = list(listed)
        names = listed_names if listed_names is not None and len(listed_names) == len(values) else None
        keys = [str(n) for n in names] if names else [str(i) for i in range(len(values))]
        return tuple(_constraint_name(k, slos) for k in keys), tuple(values)
    return (), ()


def _constraint_name(key: str, slos: Sequence[str]) -> str:
    if key.startswith("slo:"):
        return key.removeprefix("slo:")
    if key.isdigit():
        i = int(key)
        return slos[i] if i < len(slos) else f"constraint {i}"
    return key


def _constraint_order(key: str) -> tuple[int, str]:
    return (int(key), "") if key.isdigit() else (1 << 30, key)


def _parsed(text: str) -> Slo | None:
    try:
        return parse_slo(text)
    except ConfigError:  # a study written by hand may list anything: it has no latency SLO then
        return None


def first_label(trials: Sequence[TrialView]) -> str:
    """The column of the first value: output tok/s, or a cost study's cost per million output tokens."""
    costed = [t for t in trials if t.costed]
    if not costed:
        return "tok/s"
    return "$/M tok" if any(t.cost_usd_per_m_tokens is not None for t in costed) else "GPU-h/M"


def fmt_or_dash(v: float | None, spec: str, suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
