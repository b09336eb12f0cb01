"""What changed between the job a study stored and the job it is run with again, by what the change does to it.

A study's trials are figures measured under one job. Run again with an edited job, each difference is one of:

- unmeasured: how the search runs (budget, sampler, confirm, timeouts, the storage's heartbeat): it continues;
- verdicts: what the figures are judged by (the SLOs, the objective between capacity searches, the latency
  minimised): the stored trials are judged again from their stored requests;
- space: the ranges or choices searched: it continues; a stored trial outside the new space stays as history;
- measured: what the figures are of (the workload, the arrival, the model, the GPU, the launcher and what it runs,
  `time_scale`, a fixed flag every trial ran with): refused, since the study would mix two measurements.

`compare` is pure: two jobs as `Job.as_record()` gives them (the stored one read through today's schema by
`normalised`, so a field added since reads as its default on both sides).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import ValidationError

from tuner.config import Job
from tuner.config.target import LAUNCHER_KINDS
from tuner.errors import ConfigError
from tuner.scoring import parse_slo

__all__ = ["MEASURED", "SPACE", "UNMEASURED", "VERDICTS", "Change", "JobChange", "compare", "normalised"]

Kind = Literal["unmeasured", "verdicts", "space", "measured"]
UNMEASURED: Final = "unmeasured"
VERDICTS: Final = "verdicts"
SPACE: Final = "space"
MEASURED: Final = "measured"

# By the job's top-level section; `target` and a few others are decided field by field (`_kind`).
_SECTIONS: dict[str, Kind] = {
    "study": UNMEASURED,
    "budget": UNMEASURED,
    "sampler": UNMEASURED,
    "feasibility": UNMEASURED,  # which flag sets are launched, not what a launch measures
    "stop_early": UNMEASURED,  # a trial stopped at a certain miss is marked so (`slo_stop`) and judged as such
    "workload": MEASURED,
    "arrival": MEASURED,
    "request_timeout": MEASURED,  # a request that outlived the old bound would have been answered under a new one
    "slos": VERDICTS,
    "latency_metric": VERDICTS,
}
# Of the target: what only decides how long to wait, or what is passed by name only.
_TARGET_UNMEASURED = frozenset({"startup_timeout", "engine_wait"})
_LAUNCHER_UNMEASURED = frozenset({"env", "volumes"})
# Objectives whose trials run the same load phase (a capacity search over the same steps): one's stored steps are
# judged again under the other. Between a fixed load and a search, or into the cost objective, nothing can be.
_SEARCHES = frozenset({"max_rate", "goodput"})


@dataclass(frozen=True)
class Change:
    kind: Kind
    path: str  # `workload.input_len`, `slos`, `space.max_num_seqs`
    before: Any
    after: Any

    def text(self) -> str:
        return f"{self.path} {_show(self.before)} -> {_show(self.after)}"


@dataclass(frozen=True)
class JobChange:
    """The differences of one job from the stored one, each with its kind."""

    changes: tuple[Change, ...] = ()

    def of(self, kind: Kind) -> list[Change]:
        return [c for c in self.changes if c.kind == kind]

    @property
    def refused(self) -> bool:
        return bool(self.of(MEASURED))

    @property
    def rejudge(self) -> bool:
        return bool(self.of(VERDICTS))

    @property
    def space(self) -> bool:
        return bool(self.of(SPACE))

    def refusal(self, study: str) -> str:
        """The one line a refused rerun prints: what differs, why it matters, and the way forward."""
        what = "; ".join(c.text() for c in self.of(MEASURED))
        return (
            f"study {study!r} was measured under another job ({what}): its trials and new ones would be figures of "
            "two different measurements. Run the stored job to continue it, or start a new study in the same "
            "storage with `tuner tune JOB.yaml --new-study NAME`"
        )

    def lines(self) -> list[str]:
        """What changed, by kind, and what the run does about it (nothing: the job is the stored one)."""
        said = {
            UNMEASURED: "nothing measured changes, the study continues",
            VERDICTS: "the stored trials are judged again from their stored requests",
            SPACE: "the study continues in the new space; stored trials outside it stay as history",
            MEASURED: "refused: the trials would mix two measurements",
        }
        out = []
        for kind in (MEASURED, VERDICTS, SPACE, UNMEASURED):
            changes = self.of(kind)
            if changes:
                out.append(f"job changed ({kind}): {'; '.join(c.text() for c in changes)}: {said[kind]}")
        return out


def normalised(stored: Mapping[str, Any]) -> dict[str, Any]:
    """The stored job read through today's schema (a field added since takes its default), as `Job.as_record()`
    writes it; as stored where it no longer reads (a field since removed, a value since refused)."""
    try:
        return Job.model_validate(dict(stored)).as_record()
    except (ValidationError, ConfigError, ValueError):
        return dict(stored)


def compare(
    stored: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    stored_workload: str | None = None,
    current_workload: str | None = None,
    stored_vllm: str | None = None,
    current_vllm: str | None = None,
) -> JobChange:
    """Every difference of `current` from `stored` (both `Job.as_record()` dicts), classified. `*_workload`: the
    workloads' fingerprints (`Workload.fingerprint`), which also see a dataset file's contents change under one
    path (compared only where the job names a dataset: the hash also moves with the schema's fields). `*_vllm`:
    the vLLM the stored trials logged and the one the job would start (tuner.study.vllm_version)."""
    changes: list[Change] = []
    if stored_vllm and current_vllm and stored_vllm != current_vllm:
        changes.append(Change(MEASURED, "vLLM", stored_vllm, current_vllm))
    if stored_workload and current_workload and stored_workload != current_workload:
        workload = current.get("workload")
        # Only a dataset's bytes are seen by the hash alone (the rest is in the job's own fields, compared below).
        if stored.get("workload") == workload and isinstance(workload, dict) and workload.get("dataset"):
            changes.append(
                Change(MEASURED, "workload's requests (its dataset's contents)", stored_workload, current_workload)
            )
    objective = str(current.get("objective", "throughput"))
    for key in sorted(set(stored) | set(current)):
        before, after = stored.get(key), current.get(key)
        if key == "space":
            changes += _space(before if isinstance(before, dict) else {}, after if isinstance(after, dict) else {})
        elif key == "slos":
            if _slos(before) != _slos(after):
                changes.append(Change(VERDICTS, "slos", _slos(before), _slos(after)))
        elif key == "objective":
            if before != after:
                both = {str(before), str(after)}
                changes.append(Change(VERDICTS if both <= _SEARCHES else MEASURED, "objective", before, after))
        else:
            for path, b, a in _leaves(key, before, after):
                if b != a:
                    changes.append(Change(_kind(path, current, objective), path, b, a))
    return JobChange(tuple(changes))


def _kind(path: str, current: Mapping[str, Any], objective: str) -> Kind:
    head, _, rest = path.partition(".")
    if head == "capacity_search":
        return UNMEASURED if objective == "throughput" else MEASURED  # a fixed load searches nothing
    if head != "target":
        return _SECTIONS.get(head, MEASURED)  # a section this module does not know: taken as measured, to be safe
    field, _, option = rest.partition(".")
    target = current.get("target") if isinstance(current.get("target"), dict) else {}
    launcher = str((target or {}).get("launcher", ""))
    if field in _TARGET_UNMEASURED:
        return UNMEASURED
    if field == "gpu_hour_usd":
        return MEASURED if objective == "cost" else UNMEASURED  # a cost study's figures are priced with it
    if field == "profile":
        return MEASURED if launcher == "emulator" else UNMEASURED  # the emulator serves with it; else the twin's
    if field in LAUNCHER_KINDS:
        # A launcher's options: measured for the launcher that runs, but for what is passed by name only.
        if field != launcher:
            return UNMEASURED
        return UNMEASURED if option.partition(".")[0] in _LAUNCHER_UNMEASURED else MEASURED
    return MEASURED  # model, gpu, gpus, launcher, cpu_affinity


def _space(before: dict[str, Any], after: dict[str, Any]) -> list[Change]:
    """A searched flag's range or choices: the space; a fixed flag (every trial's, the baseline's too): measured."""
    out = []
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name), after.get(name)
        if b == a:
            continue
        fixed = (b is not None and not isinstance(b, dict)) or (a is not None and not isinstance(a, dict))
        out.append(Change(MEASURED if fixed else SPACE, f"space.{name}", b, a))
    return out


def _leaves(path: str, before: Any, after: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after)):
            out += _leaves(f"{path}.{key}", before.get(key), after.get(key))
        return out
    return [(path, before, after)]


def _slos(texts: Any) -> list[str]:
    """The SLOs as the scoring writes them, so `e2e_p95<=2s` and `e2e_p95 <= 2s` are one SLO."""
    out = []
    for text in texts if isinstance(texts, list) else []:
        try:
            out.append(str(parse_slo(str(text))))
        except ConfigError:
            out.append(str(text))
    return sorted(out)


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items() if v is not None) + "}"
    if isinstance(value, list):
        # In parentheses: a terminal's markup would take `[e2e_p95<=2s, ...]` for a tag and print nothing.
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return str(value)
