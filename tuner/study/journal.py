"""A measured result the database could not take, kept in a local file until it can.

When the database stays away past `study.storage_wait_s` while a trial's result is being written, the result is
appended to `.tuner-journal/<study>.jsonl` beside the job file (JSON lines, one a trial) and the run stops; the next
run of the same job writes every kept result before anything else, then removes it from the file. Written once:
a result already told (its trial COMPLETE) is not told again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from tuner.load.results import RequestRecord
from tuner.store import Store, flag_key
from tuner.store.store import TrialFields
from tuner.store.waiting import StorageGone

__all__ = ["Journal", "Kept", "ResultKept", "kept_from", "store_kept"]

JOURNAL_DIR = ".tuner-journal"


@dataclass
class Kept:
    """What a trial measured, as the objective would have written it."""

    number: int
    values: list[float]
    user_attrs: dict[str, Any]
    constraints: dict[str, float]
    detail: dict[str, Any]  # Store.save_trial's fields
    requests: list[dict[str, Any]] = field(default_factory=list)
    step: int = 0


class ResultKept(StorageGone):
    """A measured result that could not be written to its trial; `kept` holds it. `taken`: the database answers,
    but the trial was failed as dead meanwhile (by a worker that reached the database while this one could not);
    else the database went away."""

    def __init__(self, message: str, kept: Kept, *, taken: bool = False) -> None:
        super().__init__(message)
        self.kept = kept
        self.taken = taken


class Journal:
    """The kept results of one study, in `folder`/.tuner-journal/<study>.jsonl."""

    def __init__(self, folder: Path, study: str) -> None:
        self.study = study
        self.path = folder / JOURNAL_DIR / (re.sub(r"[^A-Za-z0-9._-]+", "_", study) + ".jsonl")

    def keep(self, kept: Kept) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked("a") as f:
            f.write(json.dumps(asdict(kept)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_kept(self, study: optuna.Study, store: Store, on_event: Callable[[str], None]) -> int:
        """Every kept result written to the study (and the file emptied of it): how many."""
        if not self.path.exists():
            return 0
        with self._locked("r+") as f:
            entries = [Kept(**json.loads(line)) for line in f if line.strip()]
            for i, kept in enumerate(entries):
                try:
                    store_kept(study, store, kept)
                except BaseException:
                    f.seek(0)
                    f.truncate()
                    f.writelines(json.dumps(asdict(k)) + "\n" for k in entries[i:])
                    raise
                on_event(f"trial {kept.number}: its result, kept in {self.path} while the database was away, is stored")
            f.seek(0)
            f.truncate()
        with contextlib.suppress(OSError):
            self.path.unlink()
        return len(entries)

    @contextlib.contextmanager
    def _locked(self, mode: str) -> Iterator[Any]:
        """The file, locked against the box's other workers for the duration."""
        with open(self.path, mode, encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield f
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def kept_from(trial: optuna.Trial, values: list[float], store: Store) -> Kept:
    """A trial's result as stored so far (its attributes, detail and requests), to be stored again elsewhere."""
    name = trial.study.study_name
    detail = store.trial_detail(name, trial.number)
    fields = {f: getattr(detail, f) for f in TrialFields.__annotations__} if detail is not None else {}
    step = (detail.scored_step or 0) if detail is not None else 0
    system = trial.study._storage.get_trial(trial._trial_id).system_attrs
    prefix = "constraints:"
    return Kept(
        number=trial.number,
        values=values,
        user_attrs=trial.user_attrs,
        constraints={k[len(prefix) :]: v for k, v in system.items() if k.startswith(prefix)},
        detail=fields,
        requests=[r.model_dump(mode="json") for r in store.request_records(name, trial.number, step)],
        step=step,
    )


def store_kept(study: optuna.Study, store: Store, kept: Kept) -> int | None:
    """One kept result told: to its own trial while that is still RUNNING; as a trial of its own if the heartbeat
    failed it meanwhile (its flag claim moved to it, so the heartbeat's retry is answered from it, not launched);
    not at all if it was told already. The number it is stored under (None: already stored)."""
    trial = next((t for t in study.get_trials(deepcopy=False) if t.number == kept.number), None)
    if trial is None or trial.state == TrialState.COMPLETE:
        return None
    system = {f"constraints:{k}": v for k, v in kept.constraints.items()}
    number = kept.number
    if trial.state == TrialState.RUNNING:
        storage = study._storage
        for key, value in kept.user_attrs.items():
            storage.set_trial_user_attr(trial._trial_id, key, value)
        for key, value in system.items():
            storage.set_trial_system_attr(trial._trial_id, key, value)
    else:
        added = optuna.trial.create_trial(
            params=trial.params,
            distributions=trial.distributions,
            values=kept.values,
            user_attrs=kept.user_attrs,
            system_attrs=system,
        )
        study.add_trial(added)
        number = study.get_trials(deepcopy=False)[-1].number
        flags = kept.user_attrs.get("flags")
        if isinstance(flags, dict):
            store.take_over_claim(study.study_name, flag_key(flags), kept.number, number)
    store.save_trial(study.study_name, number, **kept.detail)
    records = [RequestRecord.model_validate(r) for r in kept.requests]
    store.save_requests(study.study_name, number, records, step=kept.step)
    if trial.state == TrialState.RUNNING:
        study.tell(number, kept.values)
    return number
