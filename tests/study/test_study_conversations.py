"""A conversation job as the study takes it: the job-file rules, the preflight's probes, the trial's record."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from study_fakes import JOB, job
from typer.testing import CliRunner

from tuner.cli import app
from tuner.cli.trial_lines import trial_line
from tuner.config import Job, load_job, parse_job
from tuner.errors import ConfigError
from tuner.load import LoadResult, RequestRecord, ServerMetricsSummary
from tuner.load.prompt_fit import PromptFit
from tuner.load.results import TurnFigures
from tuner.record import TrialRecord
from tuner.scoring import summarize
from tuner.study.preflight import judge_probes
from tuner.study.samplers import sampler_name
from tuner.study.verdict import _reuse_figures
from tuner.twin.simulate import Coefficients, simulate

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
        ({"objective": "max_rate"}, "objective max_rate searches a request rate; use objective: throughput"),
        ({"objective": "goodput"}, "objective goodput searches a request rate"),
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


def test_a_conversation_job_loads_and_defaults_to_the_twin() -> None:
    j = job(workload=CONVERSATIONS, sampler={"seed": 1})
    assert j.workload.conversations is not None and j.workload.path == "/v1/chat/completions"
    assert sampler_name(j) == "twin"


def test_a_conversation_jobs_stored_record_reads_back() -> None:
    j = job(workload=CONVERSATIONS)
    again = parse_job(j.as_record())
    assert again.workload.conversations == j.workload.conversations and again.as_record() == j.as_record()


def conversation_job(**spec: Any) -> Job:
    workload = {"conversations": {"turns": 4, "input_len": 200, "output_len": 40, "system_len": 400, **spec}}
    return job(workload=workload, arrival={"concurrency": 1, "requests": 12})


def test_the_twin_sends_a_users_next_turn_after_its_answer_and_the_think_time() -> None:
    j = conversation_job(think_s=5.0)
    point = simulate(j, j.search_space().baseline())
    records = sorted(point.records, key=lambda r: r.index)
    assert [r.turn for r in records] == [0, 1, 2, 3] * 3 and all(r.ok for r in records)
    for before, after in itertools.pairwise(records):
        think = 5.0 if after.turn else 0.0
        assert after.start_s == pytest.approx(before.end_s + think, abs=1e-9)
    # Each turn's prompt is the one before, its answer and the new message.
    assert [r.prompt_tokens for r in records[:4]] == sorted({r.prompt_tokens for r in records[:4]})


def test_in_the_twin_later_turns_find_their_history_in_the_prefix_cache() -> None:
    j = conversation_job()
    ttft = {}
    for caching in (True, False):
        flags = j.search_space().baseline().model_copy(update={"enable_prefix_caching": caching})
        records = simulate(j, flags, Coefficients(step_jitter=0.0)).records
        ttft[caching] = [r.ttft_s for r in sorted(records, key=lambda r: r.index) if r.turn == 3]
    # The 4th turn's prompt is ~1100 tokens, of which all but the last message and answer are the 3rd turn's prompt:
    # the cache leaves a fraction of the prefill.
    assert all(a is not None and b is not None and a < 0.5 * b for a, b in zip(ttft[True], ttft[False], strict=True))


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


def test_the_dry_run_names_the_conversations_shape(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    workload = {"conversations": {**CONVERSATIONS["conversations"], "system_len": 50}}
    path.write_text(yaml.safe_dump({**JOB, "workload": workload}))
    result = CliRunner().invoke(app, ["tune", str(path), "--dry-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert (
        "workload: conversations of up to 3 turns, think time exponential, a 50-token system prompt;" in result.output
    )


def test_a_conversation_trials_line_shows_ttft_by_turn_and_the_cache() -> None:
    attrs = {
        "outcome": "measured", "flags": {"max_num_seqs": 8}, "output_tok_s": 200.0, "success_rate": 1.0,
        "feasible": True, "ttft_p95_first_turn_s": 1.39, "ttft_p95_later_turns_s": 0.42, "prefix_cache_hit_rate": 0.56,
    }  # fmt: skip
    trial = optuna.trial.create_trial(values=[200.0, 1.39], user_attrs=attrs)
    assert "ttft_p95 by turn 1.39s/0.42s first/later, prefix cache 56%" in trial_line(trial)
    plain = {k: v for k, v in attrs.items() if "turn" not in k}
    assert "by turn" not in trial_line(optuna.trial.create_trial(values=[200.0, 1.39], user_attrs=plain))
