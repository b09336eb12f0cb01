"""The trial record: written once by the study, read back by every reader, older studies included."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FixedTrial
from study_fakes import FakeLauncher, FakeServer, fake_measure, job

from tuner.config import LAUNCHER_KINDS, SAMPLER_NAMES
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.launch.factory import LAUNCHERS
from tuner.record import RECORD_VERSION, StoredJob, TrialRecord
from tuner.store import TrialDetail
from tuner.store.store import TrialFields
from tuner.study import Objective
from tuner.study.samplers import SAMPLERS

OLD_DB = Path(__file__).parent.parent / "data" / "study-0.1.0-693ac3b.db"


class _VersionedFacts(StartupFacts):
    """StartupFacts as a later launcher reports them, with a field this record does not list."""

    vllm_version: str | None = None
    attention_backend: str | None = None


class _VersionedLauncher(FakeLauncher):
    @contextlib.asynccontextmanager
    async def _start(self, flags: VllmFlags, study: str | None, trial: int | None) -> AsyncIterator[FakeServer]:
        self.launches.append({"flags": flags.as_dict(), "study": study, "trial": trial})
        facts = _VersionedFacts(kv_tokens=40_000, vllm_version="0.11.0", attention_backend="FLASH_ATTN")
        yield FakeServer("http://127.0.0.1:9", "fake-model", facts)


def test_a_measured_trial_writes_the_record_and_reads_it_back() -> None:
    trial = FixedTrial({"max_num_seqs": 16, "gpu_memory_utilization": 0.9})
    Objective(job(), _VersionedLauncher(), measure=fake_measure())(trial)
    record = TrialRecord.from_attrs(trial.user_attrs)
    assert record.record_version == RECORD_VERSION and record.outcome == "measured"
    assert record.vllm_version == "0.11.0" and record.kv_tokens == 40_000
    assert record.to_attrs() == trial.user_attrs  # every attribute the study wrote is the record's
    assert TrialRecord.from_attrs(record.to_attrs()) == record


def test_optional_attributes_are_written_only_when_set() -> None:
    attrs = TrialRecord(flags={"max_num_seqs": 8}, outcome="launch_failed", reason="cuda_oom").to_attrs()
    assert not {"repairs", "warnings", "message", "duplicate_of", "vllm_version"} & set(attrs)
    assert attrs["reason"] == "cuda_oom" and attrs["output_tok_s"] is None
    assert TrialRecord(duplicate_of=0).to_attrs()["duplicate_of"] == 0


def test_values_of_the_wrong_type_read_as_unknown() -> None:
    record = TrialRecord.from_attrs(
        {"output_tok_s": "fast", "kv_tokens": True, "constraints": [1, "x", 2.5], "repairs": ["ok", 3], "flags": 7}
    )
    assert record.output_tok_s is None and record.kv_tokens is None and record.flags == {}
    assert record.constraints == [1.0, 2.5] and record.repairs == ["ok"]


def test_a_study_written_by_tuner_0_1_0_reads_as_version_0(tmp_path: Path) -> None:
    copy = tmp_path / "old.db"
    shutil.copyfile(OLD_DB, copy)
    study = optuna.load_study(study_name="old-throughput", storage=f"sqlite:///{copy}")
    records = {t.number: TrialRecord.from_attrs(t.user_attrs) for t in study.trials}
    assert {r.record_version for r in records.values()} == {0}
    assert [records[n].outcome for n in range(7)] == ["skipped_infeasible"] * 3 + ["measured"] * 4
    assert records[0].baseline and records[0].reason == "kv_cache_too_small" and records[0].vllm_version is None
    assert records[3].output_tok_s == pytest.approx(97.02277038517306) and records[3].kv_tokens == 30976
    assert records[4].duplicate_of == 3 and records[4].attempts == 0
    job_record = StoredJob.of(study.user_attrs)
    assert job_record.request_timeout == 60.0 and job_record.target.launcher == "emulator"


def test_a_stored_job_reads_what_it_can() -> None:
    attrs: dict[str, Any] = {
        "job": {"target": {"docker": {"env": ["HF_TOKEN", "X"]}, "k8s": {"model_id": "m"}}, "request_timeout": "?"}
    }
    stored = StoredJob.of(attrs)
    assert stored.request_timeout is None and stored.target.docker.env == ["HF_TOKEN", "X"]
    section = stored.target.section("k8s")
    assert section is not None and section.model_id == "m"
    assert StoredJob.of({"job": None}) == StoredJob()


def test_every_sampler_and_launcher_a_job_may_name_has_a_factory() -> None:
    assert set(SAMPLERS) == set(SAMPLER_NAMES)
    assert list(LAUNCHERS) == list(LAUNCHER_KINDS)


def test_the_stores_fields_are_its_details() -> None:
    detail = set(TrialDetail.__dataclass_fields__) - {"study", "number", "created_at", "updated_at"}
    assert set(TrialFields.__annotations__) == detail
