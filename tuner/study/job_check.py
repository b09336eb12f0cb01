"""The job a rerun brings, checked against the one its study stored, before a trial runs (tuner.study.job_change).

Refused: one line, nothing written. Otherwise the study is brought to the new job: the space carried over
(tuner.study.space_carry), the trials judged again where the SLOs or the objective changed (the `Rejudge` the
caller gives: it reads the study back as the morning commands do, a layer above this one), and the stored job, its
SLOs and objective replaced, so `status`, `show` and the exports show the job the study now runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from optuna.storages import RDBStorage

from tuner.config import Job
from tuner.errors import ConfigError
from tuner.record import StudyRecord
from tuner.space import SearchSpace
from tuner.store import Store
from tuner.study.job_change import JobChange, compare, normalised
from tuner.study.space_carry import carry_space
from tuner.study.vllm_version import stored_version, version_to_run

__all__ = ["Rejudge", "settle_job"]


class Rejudge(Protocol):
    """Judge `job`'s stored trials again under its SLOs (written unless `write` is False); the line saying how many
    verdicts moved (tuner.report.rejudge.rejudge)."""

    def __call__(self, storage: RDBStorage, store: Store, job: Job, *, write: bool = True) -> str: ...


def settle_job(
    storage: RDBStorage,
    store: Store,
    job: Job,
    space: SearchSpace,
    say: Callable[[str], None],
    *,
    rejudge: Rejudge | None,
    write: bool = True,
) -> JobChange:
    """Compare `job` with its study's stored job, say what changed, and refuse or carry the study over (unless
    `write` is False: then only say what would be done). A new study, or one stored without its job, is left be."""
    name = job.study.name
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return JobChange()
    made = StudyRecord.from_attrs(storage.get_study_user_attrs(study_id))
    if made.job is None:
        return JobChange()  # tuner 0.1.0's studies, or one written by hand: nothing to compare with
    change = compare(
        normalised(made.job),
        job.as_record(),
        stored_workload=made.workload_hash,
        current_workload=job.workload.fingerprint(),
        stored_vllm=stored_version(storage, study_id),
        current_vllm=version_to_run(job),
    )
    if change.refused:
        raise ConfigError(change.refusal(name))
    for line in change.lines():
        say(line)
    if change.space:
        say(carry_space(storage, name, space, write=write).line())
    if change.rejudge:
        if rejudge is None:
            raise ConfigError(f"study {name!r}: the job's SLOs or objective changed; `tuner tune` judges it again")
        say(rejudge(storage, store, job, write=write))
    if write and change.changes:
        for key, value in {"job": job.as_record(), "slos": list(job.slos), "objective": job.objective}.items():
            storage.set_study_user_attr(study_id, key, value)
        if change.rejudge:
            # What the confirmation concluded was under the old verdicts: the run's end concludes again.
            storage.set_study_user_attr(study_id, "confirm", None)
    return change
