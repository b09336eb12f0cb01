"""A conversation job as the study takes it: the job-file rules, the preflight's probes, the trial's record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from study_fakes import JOB, job

from tuner.config import load_job
from tuner.errors import ConfigError
from tuner.load import LoadResult, RequestRecord, ServerMetricsSummary
from tuner.load.prompt_fit import PromptFit
from tuner.load.results import TurnFigures
from tuner.record import TrialRecord
from tuner.scoring import summarize
from tuner.study.preflight import judge_probes
from tuner.study.samplers import sampler_name
from tuner.study.verdict import _reuse_figures

CONVERSATIONS = {"conversations": {"turns": 3, "think_s": {"dist": "exponential", "mean": 2}, "input_len": 32}}


def error_of(tmp_path: Path, **changes: Any) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**JOB, "workload": CONVERSATIONS, **changes}))
    with pytest.raises(ConfigError) as info:
        load_job(path)
    return str(info.value)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"arrival": {"rate": 2, "requests": 10}}, "workload.conversations needs arrival.concurrency"),
        ({"objective": "max_rate"}, "objective max_rate needs single requests"),
        ({"workload": {**CONVERSATIONS, "output_len": 64}}, "give output_len under conversations"),
        ({"workload": {"conversations": {"think_s": -1}}}, "workload.conversations.think_s"),
        ({"workload": {"conversations": {"turns": {"dist": "uniform", "low": 4, "high": 2}}}}, "high (2) must be"),
    ],
)
def test_a_bad_conversation_job_is_one_line_naming_the_field(
    tmp_path: Path, changes: dict[str, Any], expected: str
) -> None:
    message = error_of(tmp_path, **changes)
    assert expected in message and "\n" not in message


def test_a_conversation_job_loads_and_defaults_to_tpe() -> None:
    j = job(workload=CONVERSATIONS, sampler={"seed": 1})
    assert j.workload.conversations is not None and j.workload.path == "/v1/chat/completions"
    assert sampler_name(j) == "tpe"


def test_the_preflight_does_not_hold_a_conversations_prompt_length_to_the_fit() -> None:
    # The history holds the server's own answers, as text: its length is the tokenizer's, not the workload's to pin.
    j = job(workload=CONVERSATIONS)
    fit = PromptFit(ids=range(10, 50), words=["a"] * 40, chat_overhead=0, exact=True, note="fitted with /tokenize")
    spec = next(j.workload.prompts(fit))
    answered = RequestRecord(
        index=0, start_s=0, prompt_tokens=spec.prompt_len + 40, completion_tokens=spec.output_len, ok=True
    )
    assert judge_probes(j, j.search_space().baseline(), "tiny", [(spec, answered)], fit).passed


def test_the_trials_record_keeps_ttft_by_turn_and_the_prefix_cache_hit_rate() -> None:
    loaded = LoadResult(
        summary=summarize([], duration_s=0.0),
        records=[],
        server=ServerMetricsSummary(samples=3, prefix_cache_hit_rate=0.6),
        turns=TurnFigures(first_turns=4, later_turns=8, ttft_p95_first_s=1.5, ttft_p95_later_s=0.25),
    )
    record = TrialRecord().model_copy(update=_reuse_figures(loaded))
    attrs = record.to_attrs()
    assert (attrs["ttft_p95_first_turn_s"], attrs["ttft_p95_later_turns_s"], attrs["prefix_cache_hit_rate"]) == (
        1.5,
        0.25,
        0.6,
    )
    assert TrialRecord.from_attrs(attrs).prefix_cache_hit_rate == 0.6
    # Single requests, no scrape: nothing written, as for any figure not measured.
    plain = TrialRecord().model_copy(
        update=_reuse_figures(LoadResult(summary=summarize([], duration_s=0.0), records=[]))
    )
    assert "prefix_cache_hit_rate" not in plain.to_attrs() and "ttft_p95_first_turn_s" not in plain.to_attrs()
