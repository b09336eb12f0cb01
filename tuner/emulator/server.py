"""The OpenAI-compatible HTTP surface, as vLLM's api_server shapes it.

Streaming is the hot path: every request gets one SSE chunk per token, built from pre-encoded byte templates
(one concatenation a token), buffered in a list the engine appends to, and written with one ASGI send per
wake-up (several chunks at once if the client side lags, as a TCP stream would coalesce them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

from tuner.emulator.engine import Engine, EngineRequest, output_length
from tuner.emulator.front_lag import FrontLag
from tuner.emulator.metrics import CONTENT_TYPE, EmulatorMetrics
from tuner.emulator.tokens import OUTPUT_WORDS, chat_token_ids, text_token_ids, token_strs
from tuner.vllm_pin import PINNED_VLLM

VLLM_VERSION = PINNED_VLLM  # the surface served (log shape, texts, metric names), checked by tests/emulator/fixtures
_WORDS = tuple(w.encode() for w in OUTPUT_WORDS)
_NWORDS = len(_WORDS)
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_DONE = b"data: [DONE]\n\n"
_ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param)


def _with_value(message: str, parameter: str, value: object) -> str:
    """VLLMValidationError's text (vllm/exceptions.py): the message, then the parameter and the value refused."""
    return f"{message} (parameter={parameter}, value={value})"


def error_response(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    # vLLM >= 0.10.1 nests the error; the OpenAI SDK reads error.message from it.
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class _Sink:
    """A request's output: SSE chunks (streaming) or a token count (non-streaming)."""

    __slots__ = (
        "buf",
        "count",
        "cut",
        "disconnected",
        "done",
        "due",
        "finals",
        "finish_reason",
        "first",
        "head",
        "req",
        "tail",
        "waiter",
        "word0",
    )

    def __init__(self, head: bytes, tail: bytes, finals: dict[str, bytes], first: bytes, word0: int) -> None:
        self.buf: list[bytes] = []
        self.head = head
        self.tail = tail
        self.finals = finals
        self.first = first
        self.word0 = word0
        self.waiter: asyncio.Future[None] | None = None
        self.done = False
        self.cut = False
        self.disconnected = False
        self.finish_reason: str | None = None
        self.count = 0
        self.req: EngineRequest | None = None  # its engine request, whose `last_token` is when a token was due
        self.due: float | None = None  # when the oldest token not yet taken for sending was due (emulated)

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def on_token(self, index: int, finish_reason: str | None) -> None:
        if self.due is None and self.req is not None:
            self.due = self.req.last_token  # the engine sets it to the step's time before it calls here
        word = _WORDS[(self.word0 + index) % _NWORDS]
        if self.head:
            if index == 0 and self.first:
                self.buf.append(self.first)
            if finish_reason is None:
                self.buf.append(self.head + word + self.tail)
            else:
                self.buf.append(self.head + word + self.finals[finish_reason])
        self.count = index + 1
        if finish_reason is not None:
            self.done = True
            self.finish_reason = finish_reason
        self._wake()

    def on_cut(self) -> None:
        self.cut = True
        self._wake()

    def text(self) -> str:
        return "".join(OUTPUT_WORDS[(self.word0 + i) % _NWORDS] for i in range(self.count))


def _usage_chunk(rid: str, chat: bool, created: int, model: str, prompt_len: int) -> Callable[[int], bytes]:
    """The closing usage chunk of a stream asked for with `stream_options.include_usage`, given the tokens sent."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def usage(count: int) -> bytes:
        chunk = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_len,
                "total_tokens": prompt_len + count,
                "completion_tokens": count,
            },
        }
        return b"data: " + _json_bytes(chunk) + b"\n\n"

    return usage


class _StreamResponse(Response):
    """Streams a request's SSE chunks (every choice's, for n > 1) as the engine produces them; aborts the request
    on disconnect. The stream's last chunk carries `system_fingerprint`, as vLLM 0.32 sends it."""

    def __init__(
        self,
        engine: Engine,
        children: list[tuple[EngineRequest, _Sink]],
        usage: Callable[[int], bytes] | None,
        fingerprint: str,
        front: FrontLag,
        started: float,
    ) -> None:
        self.front = front
        self.started = started  # when the handler took the request (the front's clock)
        self.engine = engine
        self.children = children
        self.sinks = [sink for _, sink in children]
        self.usage = usage
        self.fingerprint_tail = b',"system_fingerprint":' + json.dumps(fingerprint).encode() + b"}\n\n"
        self.background = None

    def _abort(self) -> None:
        for req, sink in self.children:
            if not sink.done:
                self.engine.abort(req)

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                for sink in self.sinks:
                    sink.disconnected = True
                self._abort()
                for sink in self.sinks:
                    sink._wake()
                return

    def _due(self) -> float | None:
        """When the oldest token taken for sending now was due; the sinks start counting afresh."""
        dues = [s.due for s in self.sinks if s.due is not None]
        for s in self.sinks:
            s.due = None
        return min(dues) if dues else None

    def _fingerprinted(self, data: bytes) -> bytes:
        # Every chunk ends in `}\n\n`: the last one gets the field before its closing brace.
        return data[:-3] + self.fingerprint_tail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sinks = self.sinks
        engine = self.engine
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        front = self.front
        opened = front.opened(self.started)
        for req, _ in self.children:
            engine.submit(req)
        watcher = asyncio.ensure_future(self._watch(receive))
        loop = asyncio.get_running_loop()
        one = sinks[0] if len(sinks) == 1 else None
        late = 0.0
        try:
            while True:
                if one is not None:
                    buf = one.buf
                    data: bytes = (buf[0] if len(buf) == 1 else b"".join(buf)) if buf else b""
                    buf.clear()
                    done = one.done
                    one.due = None
                else:
                    data = b"".join(b"".join(s.buf) for s in sinks)
                    for s in sinks:
                        s.buf.clear()
                        s.due = None
                    done = all(s.done for s in sinks)
                if data:
                    if done:
                        if self.usage is not None:
                            data += self._fingerprinted(self.usage(sum(s.count for s in sinks)))
                        else:
                            data = self._fingerprinted(data)
                        await send({"type": "http.response.body", "body": data + _DONE, "more_body": False})
                        # the answer complete: how long after its last token was due
                        late = front.now() - max(req.last_token for req, _ in self.children)
                        return
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    continue
                if any(s.cut or s.disconnected for s in sinks):
                    return  # ends the response without its closing chunk: the client sees a cut stream
                fut: asyncio.Future[None] = loop.create_future()
                for s in sinks:
                    s.waiter = fut
                await fut
        finally:
            watcher.cancel()
            self._abort()
            overdue = self._due()  # tokens emitted and never sent: the client went away waiting for them
            front.closed(opened, front.now() - overdue if overdue is not None else late)


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class OpenAiApp:
    """Builds the Starlette app around one engine."""

    def __init__(
        self,
        engine: Engine,
        metrics: EmulatorMetrics,
        served_names: tuple[str, ...],
        root: str,
        max_model_len: int,
        seed: int,
        api_key: str | None,
        is_dead: Callable[[], bool],
        ensure_engine: Callable[[], object] = lambda: None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.served_names = served_names
        self.root = root
        self.max_model_len = max_model_len
        self.seed = seed
        self.api_key = api_key
        self.is_dead = is_dead
        self.ensure_engine = ensure_engine
        # How late the HTTP front answers against the engine's clock (read anew: a test slows the engine by it).
        self.front = FrontLag(lambda: engine.clock)
        self.created = int(time.time())
        self._counter = 0
        self._id_base = os.urandom(12).hex()
        # vLLM's "full" fingerprint is its version and a hash of its config (serve/utils/fingerprint.py).
        config_hash = hashlib.sha256(f"{served_names}|{max_model_len}".encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{VLLM_VERSION}-{config_hash}"
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/ping", self.health, methods=["GET", "POST"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/emulator/stats", self.emulator_stats, methods=["GET"]),
                Route("/emulator/reset_prefix_cache", self.emulator_reset_prefix_cache, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                # As vLLM mounts it (entrypoints/serve/instrumentator/metrics.py, attach_router): prometheus_client's
                # own app below /metrics, which honours `name[]`; /metrics itself is the whole page above.
                _metrics_mount(self.metrics.registry),
            ]
        )

    # -- simple routes -------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.is_dead() else 200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def emulator_stats(self, request: Request) -> Response:
        """Not in vLLM: the engine's own counters, for benchmarks (is the step timing keeping up?)."""
        stats = self.engine.stats
        return JSONResponse(
            dataclasses.asdict(stats)
            | {
                "timing_error": stats.timing_error,
                # the engine's slips and the front's late answers: all the time the time_scale promised and lost
                "behind_s": stats.behind_s + self.front.behind_s,
                "engine_behind_s": stats.behind_s,
                "front_behind_s": self.front.behind_s,
                "late_answers": self.front.late_answers,
                "answered": self.front.answered,
                "running": len(self.engine.running),
                "waiting": len(self.engine.waiting),
            }
        )

    async def emulator_reset_prefix_cache(self, request: Request) -> Response:
        """Not in vLLM's public routes (its own reset is a dev-mode one): a load phase measured again on the same
        server starts with a cold prefix cache, as its first run did."""
        return JSONResponse({"forgotten_blocks": self.engine.pool.reset_prefix_cache()})

    async def models(self, request: Request) -> Response:
        if (denied := self._check_auth(request)) is not None:
            return denied
        data: list[dict[str, object]] = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.root,
                "parent": None,
                "max_model_len": self.max_model_len,
                "permission": [self._permission()],
            }
            for name in self.served_names
        ]
        return JSONResponse({"object": "list", "data": data})

    def _permission(self) -> dict[str, object]:
        """vLLM's ModelPermission defaults (vllm/entrypoints/serve/engine/protocol.py)."""
        return {
            "id": self._next_id("modelperm-"),
            "object": "model_permission",
            "created": self.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }

    async def openapi(self, request: Request) -> Response:
        """The paths this server answers, in an OpenAPI document's shape (vLLM's FastAPI app serves its own)."""
        paths: dict[str, dict[str, object]] = {}
        for route in self.app.routes:
            if isinstance(route, Route) and not route.path.startswith("/emulator/") and route.path != "/openapi.json":
                paths[route.path] = {m.lower(): {} for m in sorted(route.methods or ()) if m != "HEAD"}
        info = {"title": "vLLM API (tuner emulator)", "version": VLLM_VERSION}
        return JSONResponse({"openapi": "3.1.0", "info": info, "paths": paths})

    # -- generation ----------------------------------------------------------------------------------------------

    def _check_auth(self, request: Request) -> Response | None:
        if self.api_key is None:
            return None
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return None

    async def _body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            # FastAPI's RequestValidationError for a body that is not JSON, as vLLM's handler words it.
            detail = {"type": "json_invalid", "loc": f"body.{e.pos}", "msg": "JSON decode error",
                      "input": "<dict of 0 items>", "ctx": {"error": e.msg}}  # fmt: skip
            raise ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", f"body.{e.pos}") from None
        except UnicodeDecodeError as e:
            raise ApiError(400, f"JSON decode error: {e}", "Bad Request", "body") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return body

    def _model_name(self, body: dict[str, Any]) -> str:
        name = body.get("model")
        if name is None:
            return self.served_names[0]
        if name not in self.served_names:
            # vllm/entrypoints/serve/engine/serving.py (_check_model)
            aliases = ", ".join(self.served_names)
            raise ApiError(
                404, f"The model `{name}` does not exist. Valid aliases: {aliases}.", "NotFoundError", "model"
            )
        return str(name)

    def _next_id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._id_base}{self._counter:08x}"

    @staticmethod
    def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
        value = body.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(400, f"{name} must be an integer, got {value!r}.", param=name)
        return value

    def _limits(self, body: dict[str, Any], prompt_len: int, default_max: int | None) -> tuple[int, int, bool, int]:
        """max_tokens (shortened to fit), min_tokens, ignore_eos and n, refused in vLLM 0.32's order and words: the
        renderer's limits (vllm/renderers/params.py: TokenizeParams.__post_init__, _token_len_check), the output
        budget (get_max_tokens in vllm/entrypoints/serve/utils/api_utils.py: what fits beside the prompt, so a
        prompt + max_tokens over the limit is shortened, not refused), then SamplingParams._verify_args
        (vllm/sampling_params.py)."""
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        requested = self._int_field(body, name, default_max if name == "max_tokens" else None)
        min_tokens = self._int_field(body, "min_tokens", 0) or 0
        ignore_eos = bool(body.get("ignore_eos", False))
        mml = self.max_model_len
        if requested is not None and requested > mml:
            raise ApiError(
                400,
                _with_value(
                    f"{name}={requested} cannot be greater than max_model_len={mml}. Please request fewer output "
                    "tokens.",
                    name,
                    requested,
                ),
                param=name,
            )
        if prompt_len > mml:
            # A text prompt was cut at max + 1 tokens (_completion_prompt), hence "at least" for exactly that count,
            # which vLLM's _token_len_check says of token ids of that length too. Not modelled: its refusal of a text
            # longer than max_model_len x the vocabulary's longest token in characters, before tokenizing (the
            # emulator has no vocabulary; real ones hold tokens of 16+ characters, so only a huge text meets it).
            at_least = "at least " if prompt_len == mml + 1 else ""
            raise ApiError(
                400,
                _with_value(
                    f"This model's maximum context length is {mml} tokens. However, your prompt contains "
                    f"{at_least}{prompt_len} input tokens, which exceeds this limit even without any output tokens. "
                    "Please reduce the length of the input prompt.",
                    "input_tokens",
                    prompt_len,
                ),
                param="input_tokens",
            )
        max_tokens = mml - prompt_len if requested is None else min(requested, mml - prompt_len)
        n = body.get("n", 1)
        if n is None:
            n = 1
        if isinstance(n, bool) or not isinstance(n, int):
            raise ApiError(400, f"n must be an int, but is of type {type(n)}")
        if n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}.")
        self._check_temperature(body.get("temperature"))
        if max_tokens < 1:
            raise ApiError(
                400, _with_value(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens),
                param="max_tokens",
            )  # fmt: skip
        if min_tokens < 0:
            raise ApiError(400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
        if min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
        return max_tokens, min_tokens, ignore_eos, n

    @staticmethod
    def _check_temperature(value: object) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ApiError(400, f"temperature must be a number, got {value!r}.", param="temperature")
        t = float(value)
        if not math.isfinite(t):
            problem = f"temperature must be a finite number, got {t}."
        elif t < 0.0:
            problem = f"temperature must be non-negative, got {t}."
        elif t > 2.0:
            problem = f"temperature must be in [0, 2], got {t}."
        else:
            return
        raise ApiError(400, _with_value(problem, "temperature", t), param="temperature")

    @staticmethod
    def _completion_prompt(body: dict[str, Any], text_limit: int | None = None) -> list[int]:
        """The prompt's token ids; a text prompt cut after `text_limit` tokens, as vLLM 0.32's renderer tokenizes it
        for generation (TokenizeParams.get_encode_kwargs: truncation at max_model_len + 1, so a text prompt over the
        limit is refused as "at least max_model_len + 1" tokens whatever its length). Token ids and /tokenize are
        counted whole."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = text_token_ids(prompt)[:text_limit]
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            raise ApiError(400, "The emulator serves one prompt per request.", param="prompt")
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids.", param="prompt")
        if not ids:
            raise ApiError(400, "Prompt cannot be empty.", param="prompt")
        return ids

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the emulator's token count of a prompt or of chat messages."""
        if (denied := self._check_auth(request)) is not None:
            return denied
        try:
            body = await self._body(request)
            self._model_name(body)
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    raise ApiError(400, "messages must be a list of message objects.", param="messages")
                try:
                    ids = chat_token_ids(messages)
                except ValueError as e:
                    raise ApiError(400, str(e), param="messages") from None
            else:
                ids = self._completion_prompt(body)
        except ApiError as e:
            return e.response()
        # token_strs only when asked for (vllm/entrypoints/serve/tokenize/serving.py), else null.
        strs = token_strs(ids) if body.get("return_token_strs") else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        started = self.front.now()
        if (denied := self._check_auth(request)) is not None:
            return denied
        self.ensure_engine()
        try:
            body = await self._body(request)
            model = self._model_name(body)
            ids = self._chat_prompt(body) if chat else self._completion_prompt(body, text_limit=self.max_model_len + 1)
            max_tokens, min_tokens, ignore_eos, n = self._limits(body, len(ids), None if chat else 16)
            if self.is_dead():
                raise ApiError(500, _ENGINE_DEAD, "InternalServerError")
        except ApiError as e:
            return e.response()
        self.metrics.request_params(n, max_tokens)
        seed = body.get("seed")
        seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        rid = self._next_id("chatcmpl-" if chat else "cmpl-")
        created = int(time.time())
        word0 = self._counter * 7
        prompt_len = len(ids)
        # n > 1: one engine request per choice, as vLLM fans a parent request out into child requests
        # (vllm/v1/engine/parallel_sampling.py); each child draws its own natural length.
        children: list[tuple[EngineRequest, _Sink]] = []
        for i in range(n):
            target, reason = output_length(
                self.seed, ids, max_tokens, min_tokens, ignore_eos, seed if i == 0 else (seed or 0) * 1_000_003 + i
            )
            sink = (
                self._stream_sink(rid, created, model, chat, word0 + 13 * i, i)
                if stream
                else _Sink(b"", b"", {}, b"", word0 + 13 * i)
            )
            engine_id = rid if n == 1 else f"{i}_{rid}"
            req = EngineRequest(engine_id, ids, target, reason, sink, self.engine.block_size, self.engine.caching)
            sink.req = req
            children.append((req, sink))
        if stream:
            usage = _usage_chunk(rid, chat, created, model, prompt_len) if include_usage else None
            return _StreamResponse(self.engine, children, usage, self.fingerprint, self.front, started)
        return await self._wait_full(children, rid, created, model, chat, prompt_len, started)

    @staticmethod
    def _chat_prompt(body: dict[str, Any]) -> list[int]:
        """A chat request's prompt tokens; ApiError (400) for messages that are not a list of message objects."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects.", param="messages")
        try:
            return chat_token_ids(messages)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None

    def _stream_sink(self, rid: str, created: int, model: str, chat: bool, word0: int, index: int = 0) -> _Sink:
        """Byte templates of one choice's chunks, in vLLM 0.32's key sets (serving.py of the completion and chat
        entrypoints): a chat stream opens with the role and the prompt fields, completion chunks carry
        prompt_token_ids and token_ids (null unless asked for)."""
        prefix = (
            f'data: {{"id":"{rid}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
            f'"created":{created},"model":{json.dumps(model)},"choices":[{{"index":{index},'
        )
        if chat:
            head = (prefix + '"delta":{"content":"').encode()
            tail = b'"},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
            finals = {
                r: f'"}},"logprobs":null,"finish_reason":"{r}","stop_reason":null,"token_ids":null}}]}}\n\n'.encode()
                for r in ("stop", "length")
            }
            first = (
                prefix + '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
                '"prompt_token_ids":null,"prompt_text":null}\n\n'
            )
            return _Sink(head, tail, finals, first.encode(), word0)
        head = (prefix + '"text":"').encode()
        tail = (
            b'","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
        )
        finals = {
            r: (
                f'","logprobs":null,"finish_reason":"{r}","stop_reason":null,"prompt_token_ids":null,'
                '"token_ids":null}]}\n\n'
            ).encode()
            for r in ("stop", "length")
        }
        return _Sink(head, tail, finals, b"", word0)

    async def _wait_full(
        self, children: list[tuple[EngineRequest, _Sink]], rid: str, created: int, model: str, chat: bool,
        prompt_len: int, started: float,
    ) -> Response:  # fmt: skip
        loop = asyncio.get_running_loop()
        opened = self.front.opened(started)
        for req, _ in children:
            self.engine.submit(req)
        sinks = [sink for _, sink in children]
        try:
            while not all(s.done for s in sinks) and not any(s.cut for s in sinks):
                fut: asyncio.Future[None] = loop.create_future()
                for s in sinks:
                    s.waiter = fut
                await fut
        finally:
            for req, sink in children:
                if not sink.done:
                    self.engine.abort(req)
            # the answer is due when its last token was (one the engine has not finished is not the front's lateness)
            done = all(s.done for s in sinks)
            self.front.closed(opened, self.front.now() - max(r.last_token for r, _ in children) if done else 0.0)
        if any(s.cut for s in sinks):
            return error_response(500, _ENGINE_DEAD, "InternalServerError")
        generated = sum(s.count for s in sinks)
        usage = {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + generated,
            "completion_tokens": generated,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        choices = [_choice(index, sink, chat) for index, sink in enumerate(sinks)]
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": usage,
        }
        if chat:
            out |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        out |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return JSONResponse(out)


def _choice(index: int, sink: _Sink, chat: bool) -> dict[str, Any]:
    """One choice of a whole (non-streamed) answer, in vLLM 0.32's key set: the fields it sends null unless asked
    for (token ids, routed experts, logprobs) are there as null."""
    if chat:
        message = {
            "role": "assistant",
            "content": sink.text(),
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        return {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": sink.finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
    return {
        "index": index,
        "text": sink.text(),
        "logprobs": None,
        "finish_reason": sink.finish_reason,
        "stop_reason": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "token_ids": None,
        "routed_experts": None,
    }


def _metrics_mount(registry: CollectorRegistry) -> Mount:
    mount = Mount("/metrics", make_asgi_app(registry=registry))
    mount.path_regex = re.compile("^/metrics(?P<path>.*)$")  # vLLM's workaround for the 307 of /metrics/
    return mount
