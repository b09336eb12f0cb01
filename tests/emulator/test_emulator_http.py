"""The emulator's HTTP surface, served in-process on 127.0.0.1 (uvicorn + the engine in the test's loop)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tuner.emulator import Emulator

ARGS = ["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--max-model-len", "8192", "--time-scale", "50"]


@pytest.fixture
async def served() -> AsyncIterator[tuple[Emulator, str]]:
    emu = Emulator.from_args(ARGS, log_stream=io.StringIO())
    async with emu.serve_http(host="127.0.0.1", port=0) as base_url:
        yield emu, base_url


async def _sse_events(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> list[str]:
    events: list[str] = []
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


async def test_health_models_and_streamed_completion(served: tuple[Emulator, str]) -> None:
    _, base = served
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "llama-3.1-8b"
        assert models["data"][0]["max_model_len"] == 8192
        body = {
            "model": "llama-3.1-8b",
            "prompt": list(range(100)),
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = await _sse_events(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c for c in chunks if c["choices"]]
    assert len(tokens) == 12  # one chunk a generated token, as vLLM streams
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 11 + ["length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 100, "total_tokens": 112, "completion_tokens": 12}


async def test_openai_sdk_streams_chat_and_completion(served: tuple[Emulator, str]) -> None:
    _, base = served
    async with AsyncOpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0) as client:
        chat = await client.chat.completions.create(
            model="llama-3.1-8b",
            messages=[{"role": "user", "content": "Say something about GPUs."}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        parts: list[str] = []
        usage = None
        async for chunk in chat:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(parts) == 8 and "".join(parts).strip()
        assert usage is not None and usage.completion_tokens == 8 and usage.prompt_tokens > 6

        completion = await client.completions.create(
            model="llama-3.1-8b", prompt="Once upon a time", max_tokens=5, stream=True, extra_body={"min_tokens": 5}
        )
        texts = [c.choices[0].text async for c in completion if c.choices]
        assert len(texts) == 5


async def test_errors_look_like_vllm(served: tuple[Emulator, str]) -> None:
    _, base = served
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        r = await client.post(
            "/v1/completions", json={"model": "llama-3.1-8b", "prompt": [1] * 100, "max_tokens": 8100}
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400
        assert err["message"] == (
            "This model's maximum context length is 8192 tokens. However, you requested 8200 tokens "
            "(100 in the messages, 8100 in the completion). Please reduce the length of the messages or completion."
        )
        r = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = await client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user"}]})
        assert r.status_code == 404 and r.json()["error"]["message"] == "The model `gpt-4` does not exist."


async def test_metrics_have_vllm_names(served: tuple[Emulator, str]) -> None:
    emu, base = served
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        body = {"prompt": "hello world", "max_tokens": 4, "ignore_eos": True}
        results = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(3)))
        assert all(r.status_code == 200 for r in results)
        assert results[0].json()["usage"]["completion_tokens"] == 4
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:cache_config_info",
    ):
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    labels = (("engine", "0"), ("model_name", "llama-3.1-8b"))
    assert samples[("vllm:generation_tokens_total", labels)] == 12
    assert samples[("vllm:request_success_total", (*labels[:1], ("finished_reason", "length"), labels[1]))] == 3
    assert samples[("vllm:e2e_request_latency_seconds_count", labels)] == 3
    info = next(s for s in families["vllm:cache_config_info"].samples)
    assert info.labels["num_gpu_blocks"] == str(emu.plan.num_gpu_blocks)
    assert info.labels["block_size"] == "16" and info.labels["gpu_memory_utilization"] == "0.9"
