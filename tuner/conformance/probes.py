"""The HTTP questions the conformance fixtures ask a server, and its answers reduced to shapes.

The same probes run against real vLLM (the recorder) and against the emulator (the fast suite), so a difference
is a difference of the servers, never of the questions. Prompts are token ids below 1,000 (inside any vocabulary the
tests use) so that prompt lengths, and every message quoting them, are the same on both servers whatever their
tokenizers (the one text prompt over the limit is refused with a count that does not depend on its tokenizer); outputs
are pinned with `ignore_eos` + `min_tokens` for the same reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from tuner.conformance.shape import collapse, shape_of

USAGE = ("usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens")


@dataclass(frozen=True)
class Probe:
    name: str
    method: str
    path: str
    body: dict[str, Any] | None = None
    keep: tuple[str, ...] = ()  # dotted paths whose values are stable for this probe
    raw: bytes | None = None  # a body sent as is (malformed JSON)


def _ids(n: int) -> list[int]:
    return [(7 * i) % 900 + 10 for i in range(n)]


def _words(n: int) -> str:
    return " ".join(("ka", "lo", "mi", "nu")[i % 4] for i in range(n))


_CHAT = [{"role": "user", "content": "hello there"}]
_PINNED = {"ignore_eos": True, "min_tokens": 4, "max_tokens": 4}
_STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}
_ERRORS = ("error.message", "error.type", "error.param", "error.code")


def http_probes(model: str, max_model_len: int) -> list[Probe]:
    """Every probe, for a server answering to `model` with `max_model_len` (the fixtures use 1,024)."""
    return _answer_probes(model) + _refusal_probes(model, max_model_len)


def _answer_probes(model: str) -> list[Probe]:
    """The answers to good requests: routes of state, tokenizer, both APIs whole and streamed, n > 1."""
    chat, stream_usage = _CHAT, _STREAM_USAGE
    completion = {"model": model, "prompt": _ids(12), **_PINNED}
    chat_body = {"model": model, "messages": chat, **_PINNED}
    return [
        Probe("version", "GET", "/version", keep=("version",)),
        Probe("models", "GET", "/v1/models", keep=("data[].id", "data[].max_model_len")),
        Probe("tokenize_prompt", "POST", "/tokenize", {"model": model, "prompt": "hello there"}, ("max_model_len",)),
        Probe(
            "tokenize_token_strs",
            "POST",
            "/tokenize",
            {"model": model, "prompt": "hello there", "return_token_strs": True},
            ("max_model_len",),
        ),
        Probe("tokenize_chat", "POST", "/tokenize", {"model": model, "messages": chat}, ("max_model_len",)),
        Probe("completion", "POST", "/v1/completions", completion, USAGE),
        Probe("completion_stream", "POST", "/v1/completions", {**completion, "stream": True}),
        Probe("completion_stream_usage", "POST", "/v1/completions", {**completion, **stream_usage}, USAGE),
        Probe("chat", "POST", "/v1/chat/completions", chat_body, ("usage.completion_tokens",)),
        Probe("chat_stream", "POST", "/v1/chat/completions", {**chat_body, "stream": True}),
        Probe(
            "chat_stream_usage",
            "POST",
            "/v1/chat/completions",
            {**chat_body, **stream_usage},
            ("usage.completion_tokens",),
        ),
        Probe("chat_n2", "POST", "/v1/chat/completions", {**chat_body, "n": 2}, ("usage.completion_tokens",)),
        Probe("completion_n2", "POST", "/v1/completions", {**completion, "n": 2}, USAGE),
        Probe("completion_n2_stream", "POST", "/v1/completions", {**completion, "n": 2, **stream_usage}, USAGE),
    ]


# one piece: a table of probes, one a case at vLLM's limits or a bad request, each beside why vLLM answers so
def _refusal_probes(model: str, max_model_len: int) -> list[Probe]:
    """The context-length cases (refused or shortened), an unknown model, bad parameters, a body not JSON."""
    over = max_model_len + 1
    chat, errors = _CHAT, _ERRORS
    completion = {"model": model, "prompt": _ids(12), **_PINNED}
    return [
        # 0.32 validates each limit alone (renderers/params.py) and shortens an output that only together with
        # the prompt overflows the limit (HTTP 200, finish_reason "length").
        Probe(
            "prompt_too_long",
            "POST",
            "/v1/completions",
            {"model": model, "prompt": _ids(over), "max_tokens": 1},
            errors,
        ),
        # A text prompt over the limit: the renderer tokenizes text with truncation at max_model_len + 1
        # (TokenizeParams.get_encode_kwargs), so the refusal says "at least max_model_len + 1" whatever the length.
        # One-token words under 4 characters: the same count on the recorded word-level tokenizer and the emulator's,
        # and far below the characters-per-token bound vLLM refuses text at before tokenizing.
        Probe(
            "text_prompt_too_long",
            "POST",
            "/v1/completions",
            {"model": model, "prompt": _words(max_model_len + 76), "max_tokens": 1},
            errors,
        ),
        Probe(
            "max_tokens_too_long",
            "POST",
            "/v1/completions",
            {"model": model, "prompt": _ids(10), "max_tokens": max_model_len + 100},
            errors,
        ),
        Probe(
            "prompt_plus_max_tokens_too_long",
            "POST",
            "/v1/completions",
            {"model": model, "prompt": _ids(max_model_len - 24), "max_tokens": 100, "ignore_eos": True},
            USAGE,
        ),
        # The same with the output pinned (min_tokens = max_tokens, as a benchmark pins it): the shortened
        # max_tokens falls below min_tokens, which SamplingParams refuses.
        Probe(
            "prompt_plus_pinned_output_too_long",
            "POST",
            "/v1/completions",
            {
                "model": model,
                "prompt": _ids(max_model_len - 24),
                "max_tokens": 100,
                "min_tokens": 100,
                "ignore_eos": True,
            },
            errors,
        ),
        Probe(
            "prompt_fills_context",
            "POST",
            "/v1/completions",
            {"model": model, "prompt": _ids(max_model_len), "max_tokens": 4},
            errors,
        ),
        Probe(
            "chat_max_tokens_too_long",
            "POST",
            "/v1/chat/completions",
            {"model": model, "messages": chat, "max_tokens": max_model_len + 100},
            errors,
        ),
        Probe("unknown_model", "POST", "/v1/completions", {**completion, "model": "nope"}, errors),
        Probe("n_zero", "POST", "/v1/completions", {**completion, "n": 0}, errors),
        Probe("negative_temperature", "POST", "/v1/completions", {**completion, "temperature": -1}, errors),
        Probe("unknown_field", "POST", "/v1/completions", {**completion, "no_such_field": 1}, USAGE),
        Probe("max_tokens_zero", "POST", "/v1/completions", {**completion, "max_tokens": 0, "min_tokens": 0}, errors),
        Probe("not_json", "POST", "/v1/completions", raw=b"{not json", keep=("error.type", "error.code")),
    ]


def _parse_sse(text: str) -> tuple[list[Any], bool]:
    events: list[Any] = []
    done = False
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


async def run_probe(client: httpx.AsyncClient, probe: Probe) -> dict[str, Any]:
    """One probe's answer: HTTP status, content type, and the body's shape (a stream's chunk shapes in order)."""
    if probe.raw is not None:
        r = await client.request(
            probe.method, probe.path, content=probe.raw, headers={"content-type": "application/json"}
        )
    else:
        r = await client.request(probe.method, probe.path, json=probe.body)
    content_type = r.headers.get("content-type", "").split(";")[0]
    out: dict[str, Any] = {"status": r.status_code, "content_type": content_type}
    if content_type == "text/event-stream":
        events, done = _parse_sse(r.text)
        out["chunks"] = collapse([shape_of(e, probe.keep) for e in events])
        out["done"] = done
        # n > 1 interleaves the choices' chunks; which indices appear is the surface, how they interleave timing.
        out["choice_indices"] = sorted({c["index"] for e in events for c in e.get("choices", [])})
    elif content_type == "application/json":
        body = r.json()
        out["body"] = shape_of(body, probe.keep)
        if isinstance(body.get("choices"), list):
            out["choice_indices"] = [c.get("index") for c in body["choices"]]
    else:
        out["body_bytes"] = len(r.content)
    return out


async def probe_routes(client: httpx.AsyncClient) -> dict[str, list[str]]:
    """Path -> methods, from the server's OpenAPI document."""
    r = await client.get("/openapi.json")
    r.raise_for_status()
    paths: dict[str, dict[str, Any]] = r.json()["paths"]
    return {p: sorted(m.upper() for m in methods) for p, methods in sorted(paths.items())}


async def probe_http(client: httpx.AsyncClient, model: str, max_model_len: int) -> dict[str, Any]:
    answers = {p.name: await run_probe(client, p) for p in http_probes(model, max_model_len)}
    health = await client.get("/health")
    answers["health"] = {"status": health.status_code, "body_bytes": len(health.content)}
    return {"routes": await probe_routes(client), "probes": answers, "requests": _requests(model, max_model_len)}


def _requests(model: str, max_model_len: int) -> dict[str, Any]:
    """What each probe sent, so a reader of the fixture sees the question beside the answer."""
    out: dict[str, Any] = {}
    for p in http_probes(model, max_model_len):
        body: Any = p.raw.decode() if p.raw is not None else p.body
        if isinstance(body, dict) and isinstance(body.get("prompt"), list):
            body = {**body, "prompt": f"<{len(body['prompt'])} token ids>"}
        elif isinstance(body, dict) and isinstance(body.get("prompt"), str) and len(body["prompt"]) > 80:
            body = {**body, "prompt": f"<text of {len(body['prompt'].split())} words>"}
        out[p.name] = {"method": p.method, "path": p.path, "body": body}
    return out


@dataclass
class MetricFamily:
    type: str
    labels: list[str]
    label_values: dict[str, list[str]] = field(default_factory=dict)
