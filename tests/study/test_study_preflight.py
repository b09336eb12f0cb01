"""The preflight's judgement: probe requests of the job's workload against a server (httpx.MockTransport), and the
verdict on a trial's load whose every request was refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from study_fakes import FakeServer, job

from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.load import PromptSpec, RequestRecord
from tuner.load.prompt_fit import PromptFit
from tuner.study.preflight import (
    INVALID,
    PROBES,
    PreflightResult,
    WorkloadRejected,
    api_key_advice,
    check_workload,
    judge_probes,
    workload_fault,
)

Handler = Callable[[httpx.Request], httpx.Response]


def sse(*events: dict[str, Any]) -> httpx.Response:
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def completion(prompt_tokens: int, completion_tokens: int) -> httpx.Response:
    tokens = [{"choices": [{"index": 0, "text": " w", "finish_reason": None}]} for _ in range(completion_tokens)]
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return sse(*tokens, {"choices": [], "usage": usage})


def vllm_error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "BadRequestError", "code": status}})


def server_with(answer: Handler, sent: list[dict[str, Any]]) -> Handler:
    """A vLLM look-alike without /tokenize (prompts unfitted) whose completions route answers `answer`."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/tokenize", "/detokenize"):
            return httpx.Response(404, json={"detail": "Not Found"})
        sent.append(json.loads(request.content))
        return answer(request)

    return handle


def check(answer: Handler, flags: VllmFlags | None = None, **job_changes: Any) -> tuple[PreflightResult, list[Any]]:
    sent: list[dict[str, Any]] = []
    j = job(**job_changes)
    server = FakeServer("http://vllm.test", "tiny", StartupFacts())

    async def go() -> PreflightResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server_with(answer, sent))) as client:
            return await check_workload(server, j, flags or j.search_space().baseline(), client=client)  # type: ignore[arg-type]

    return asyncio.run(go()), sent


def test_a_server_that_answers_every_probe_as_pinned_passes() -> None:
    result, sent = check(lambda r: completion(256, 32))
    assert result.passed
    assert len(sent) == PROBES
    # The job's own requests: its API, its lengths, its model, its output pinned.
    assert all(b["model"] == "tiny" and b["max_tokens"] == 32 and b["ignore_eos"] for b in sent)
    assert all(len(b["prompt"]) == 256 for b in sent)
    # Unfitted prompts (no /tokenize) cannot be counted against: said, not judged.
    assert "prompt lengths unchecked" in result.note


def test_token_ids_outside_the_vocabulary_stop_with_what_was_sent_what_came_back_and_what_to_change() -> None:
    with pytest.raises(WorkloadRejected) as e:
        check(lambda r: vllm_error(400, "Token id 29674 is out of vocabulary"))
    message = str(e.value)
    assert message.startswith(INVALID)
    assert "POST /v1/completions" in message and "'tiny'" in message and "256-token prompt" in message
    assert "HTTP 400: Token id 29674 is out of vocabulary" in message
    assert "workload.api: chat" in message
    assert "\n" not in message and e.value.reason == "http_4xx"


def test_an_api_key_the_server_wants_is_named() -> None:
    with pytest.raises(WorkloadRejected) as e:
        check(lambda r: httpx.Response(401, json={"error": "Unauthorized"}))
    assert "HTTP 401" in str(e.value) and "the server wants an API key" in str(e.value)
    assert "the load sends no API key" in str(e.value)


def _target(launcher: str, **section: Any) -> dict[str, Any]:
    gpu = "l4" if launcher == "emulator" else {"name": "l4", "memory_gib": 24}
    return {"launcher": launcher, "model": "llama-3.1-8b", "gpu": gpu, launcher: section}


def test_a_key_in_the_process_command_is_named_there_and_dropping_it_is_the_fix() -> None:
    command = ["tuner", "emulate", "{model}", "--api-key", "s3cret"]
    advice = api_key_advice(job(target=_target("process", command=command)), {})
    assert "--api-key is in target.process.command: drop it from the command" in advice
    assert "the load sends no API key" in advice
    # Nothing said about where the key did not come from: the environment held none.
    assert "environment" not in advice and "s3cret" not in advice


def test_a_key_in_the_command_written_with_an_equals_sign_is_found_too() -> None:
    advice = api_key_advice(job(target=_target("process", command=["vllm", "serve", "--api-key=k"])), {})
    assert "--api-key is in target.process.command" in advice


def test_a_key_the_process_server_inherits_from_the_environment_says_unset_it() -> None:
    advice = api_key_advice(job(target=_target("process", env=["VLLM_API_KEY"])), {"VLLM_API_KEY": "k"})
    assert "VLLM_API_KEY is set in the environment `tuner tune` runs in, which the server inherits" in advice
    assert "unset it there" in advice and "command" not in advice


def test_a_key_the_process_options_set_is_named_there() -> None:
    section = {"options": {"env": {"VLLM_API_KEY": "k"}}}
    advice = api_key_advice(job(target=_target("process", **section)), {})
    assert "target.process.options.env sets VLLM_API_KEY: remove it there" in advice


def test_a_key_passed_to_the_container_by_name_is_named_in_the_docker_env() -> None:
    advice = api_key_advice(job(target=_target("docker", env=["HF_TOKEN", "VLLM_API_KEY"])), {"VLLM_API_KEY": "k"})
    assert "target.docker.env passes VLLM_API_KEY to the container: remove VLLM_API_KEY from that list" in advice


def test_a_docker_env_name_unset_in_the_environment_passed_nothing_and_is_not_blamed() -> None:
    # The container only gets the names the tuner's environment sets: the container environment is not inherited.
    advice = api_key_advice(job(target=_target("docker", env=["VLLM_API_KEY"])), {"HOME": "/root"})
    assert "nothing in target.docker sets one" in advice and "image or configuration" in advice


def test_a_key_the_job_does_not_show_points_at_the_servers_own_configuration() -> None:
    advice = api_key_advice(job(), {"VLLM_API_KEY": "k"})  # the emulator neither inherits nor reads it
    assert "nothing in target.emulator sets one" in advice and "start it without a key" in advice


def test_a_model_the_server_does_not_serve_names_the_settings_the_launcher_has() -> None:
    with pytest.raises(WorkloadRejected) as e:
        check(lambda r: vllm_error(404, "The model `tiny` does not exist."))
    assert str(e.value).endswith("check target.model")
    assert "options.served_model_name" not in str(e.value)  # the emulator section has no options
    given = _target("emulator", extra_args=["--served-model-name", "x"])
    with pytest.raises(WorkloadRejected) as e:
        check(lambda r: vllm_error(404, "The model `tiny` does not exist."), target=given)
    assert str(e.value).endswith("check target.model, --served-model-name in target.emulator.extra_args")
    command = ["vllm", "serve", "{model}", "--served-model-name", "x"]
    with pytest.raises(WorkloadRejected) as e:
        check(lambda r: vllm_error(404, "The model `tiny` does not exist."), target=_target("process", command=command))
    assert "target.process.options.served_model_name" in str(e.value)
    assert "--served-model-name in target.process.command or extra_args" in str(e.value)


def test_a_chat_request_to_a_model_without_a_chat_template_is_the_jobs() -> None:
    refusal = "As of transformers v4.44, default chat template is no longer allowed, so you must provide one"
    with pytest.raises(WorkloadRejected) as e:
        check(lambda r: vllm_error(400, refusal), workload={"input_len": 256, "output_len": 32, "api": "chat"})
    assert "POST /v1/chat/completions" in str(e.value) and "workload.api: completions" in str(e.value)


def test_an_output_the_server_shortens_under_a_fixed_max_model_len_is_the_jobs() -> None:
    with pytest.raises(WorkloadRejected) as e:
        check(lambda r: completion(256, 7))
    assert e.value.reason == "short_output"
    assert "asked 32 output tokens, got 7" in str(e.value)
    assert "space.max_model_len at least 288" in str(e.value)


def test_a_length_refusal_under_a_max_model_len_the_study_tunes_is_the_flags() -> None:
    space = {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": {"choices": [256, 4096]}}
    j = job(space=space)
    short = j.search_space().repair({"max_num_seqs": 8, "max_model_len": 256}).flags
    result, _ = check(lambda r: completion(256, 7), flags=short, space=space)
    assert not result.passed and "got 7" in result.note
    # The longest the space allows and still short: no flag can fix it.
    longest = j.search_space().repair({"max_num_seqs": 8, "max_model_len": 4096}).flags
    with pytest.raises(WorkloadRejected):
        check(lambda r: completion(256, 7), flags=longest, space=space)


@pytest.mark.parametrize(
    "answer",
    [
        lambda r: vllm_error(500, "EngineCore died"),
        lambda r: vllm_error(429, "too many requests"),
        lambda r: httpx.Response(503, text="busy"),
    ],
)
def test_what_the_flags_or_the_load_may_cause_is_inconclusive(answer: Handler) -> None:
    result, sent = check(answer)
    assert not result.passed and len(sent) == 1


def test_a_server_counting_other_prompt_lengths_than_the_fit_meant_is_refused() -> None:
    j = job()
    fit = PromptFit(ids=range(10, 50), words=["a"] * 40, chat_overhead=0, exact=True, note="fitted with /tokenize")
    spec = PromptSpec(prompt=list(range(10, 266)), prompt_len=256, output_len=32)

    def answered(prompt_tokens: int) -> RequestRecord:
        return RequestRecord(index=0, start_s=0, prompt_tokens=prompt_tokens, completion_tokens=32, ok=True)

    flags = j.search_space().baseline()
    assert judge_probes(j, flags, "tiny", [(spec, answered(256))], fit).passed
    with pytest.raises(WorkloadRejected) as e:
        judge_probes(j, flags, "tiny", [(spec, answered(257))], fit)
    assert e.value.reason == "prompt_length" and "counted 257 prompt tokens" in str(e.value)
    # Chat templates may join a word to their markup: a stated slack.
    chat = job(workload={"input_len": 256, "output_len": 32, "api": "chat"})
    text = PromptSpec(prompt="a " * 250, prompt_len=256, output_len=32)
    assert judge_probes(chat, flags, "tiny", [(text, answered(258))], fit).passed
    with pytest.raises(WorkloadRejected):
        judge_probes(chat, flags, "tiny", [(text, answered(259))], fit)


def failed(cls: Any, message: str, n: int = 4) -> list[RequestRecord]:
    return [
        RequestRecord(index=i, start_s=0, e2e_s=0.01, ok=False, error_class=cls, error_message=message)
        for i in range(n)
    ]


def test_a_load_refused_alike_in_every_request_is_the_workloads() -> None:
    j = job()
    flags = j.search_space().baseline()
    fault = workload_fault(j, flags, failed("http_4xx", "HTTP 404: The model `nope` does not exist."))
    assert fault is not None and "every one of the trial's 4 requests" in str(fault)
    assert "check target.model" in str(fault)
    ok = RequestRecord(index=9, start_s=0, ok=True, completion_tokens=32)
    assert workload_fault(j, flags, [*failed("http_4xx", "HTTP 400: bad"), ok]) is None
    assert workload_fault(j, flags, failed("timeout", "no complete reply within 30s")) is None
    assert workload_fault(j, flags, failed("http_4xx", "HTTP 429: slow down")) is None
    assert workload_fault(j, flags, failed("http_5xx", "HTTP 500: boom")) is None
    mixed = [*failed("http_4xx", "HTTP 400: bad", 2), *failed("short_output", "asked 32, got 3", 2)]
    assert workload_fault(j, flags, mixed) is None
