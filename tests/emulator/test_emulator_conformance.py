"""The emulator against the pinned real vLLM: the conformance fixtures recorded from it (tests/emulator/fixtures,
`scripts/record-vllm-conformance`), asked again of the emulator and compared shape by shape.

Every difference is a line; the allow-list below names the ones the emulator means, each with its reason. Any other
difference fails with its line, and an allow-list entry that no longer matches anything fails too, so the list
stays the list of what differs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.emulator.conformance_emulator import model_dir, record_emulator
from tuner.conformance.compare import compare_http, compare_metrics, compare_startup, unexplained, unused
from tuner.conformance.fixtures import fixture_dir, read_fixture
from tuner.vllm_pin import PINNED_VLLM

FIXTURES = fixture_dir(Path(__file__).parent / "fixtures")

# Where the emulator deliberately differs from the recorded vLLM (a CPU build serving the tiny model), which it is
# asked to imitate as such (`--device cpu`, the recording's VLLM_CPU_KVCACHE_SPACE; tests/emulator/
# conformance_emulator.py): its start-up lines and its refusals (each asked with the flags and environment vLLM was
# refused with) need no allowance.
ALLOWED: dict[str, str] = {
    # Routes the tuner never calls and the emulator does not model: tokenizer round trips, other APIs (Responses,
    # Anthropic Messages, SageMaker, scoring, batch), and the elastic-EP / KV-event / load-report plumbing.
    "routes./detokenize: not served": "the tuner never detokenizes",
    "routes./generative_scoring: not served": "a scoring API, not generation",
    "routes./invocations: not served": "SageMaker's entry point",
    "routes./is_scaling_elastic_ep: not served": "elastic expert parallelism",
    "routes./scale_elastic_ep: not served": "elastic expert parallelism",
    "routes./kv_event_sources: not served": "KV-cache event publishing",
    "routes./load: not served": "the load-report route of vLLM's router integration",
    "routes./v1/chat/completions/batch: not served": "batch chat",
    "routes./v1/messages*: not served": "the Anthropic Messages API",
    "routes./v1/responses*: not served": "the OpenAI Responses API",
    "routes./v1/systemone: not served": "a vendor route of vLLM's",
}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    # One recording for the module, in its own event loop (the emulator's engine task lives and ends in it).
    return asyncio.run(record_emulator(FIXTURES, model_dir(FIXTURES, tmp_path_factory.mktemp("model"))))


def _differences(emulated: dict[str, dict[str, Any]]) -> list[str]:
    return (
        compare_http(read_fixture(FIXTURES, "http"), emulated["http"])
        + compare_metrics(read_fixture(FIXTURES, "metrics"), emulated["metrics"])
        + compare_startup(read_fixture(FIXTURES, "startup"), emulated["startup"])
    )


def test_the_fixtures_are_the_pinned_vllms() -> None:
    for name in ("server", "http", "metrics", "startup"):
        assert read_fixture(FIXTURES, name)["vllm_version"] == PINNED_VLLM, name
    assert read_fixture(FIXTURES, "http")["probes"]["version"]["body"] == {"version": PINNED_VLLM}


def test_the_emulator_answers_as_the_recorded_vllm(emulated: dict[str, dict[str, Any]]) -> None:
    left = unexplained(_differences(emulated), ALLOWED)
    assert not left, "the emulator differs from vLLM " + PINNED_VLLM + ":\n" + "\n".join(left)


def test_every_allowance_is_still_needed(emulated: dict[str, dict[str, Any]]) -> None:
    assert not unused(_differences(emulated), ALLOWED)


def test_a_difference_is_found_and_named(emulated: dict[str, dict[str, Any]]) -> None:
    """The comparison is not vacuous: an emulator answer moved by hand is reported where it moved."""
    http = read_fixture(FIXTURES, "http")
    moved = {**emulated["http"], "probes": dict(emulated["http"]["probes"])}
    moved["probes"]["unknown_model"] = {**moved["probes"]["unknown_model"], "status": 400}
    del moved["routes"]["/tokenize"]
    found = unexplained(compare_http(http, moved), ALLOWED)
    assert found == ["routes./tokenize: not served", "probes.unknown_model.status: got 400, expected 404"]


def test_the_recorder_says_how_to_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    from tuner.conformance.record import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "example:" in out and "scripts/record-vllm-conformance" in out


def test_the_recorder_without_real_vllm_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tuner.conformance.record import main

    monkeypatch.delenv("TUNER_TEST_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("TUNER_TEST_VLLM_MODEL", raising=False)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TUNER_TEST_VLLM_PYTHON" in err and "scripts/real-vllm" in err
