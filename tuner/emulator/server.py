"""The OpenAI-compatible HTTP surface, as vLLM's api_server shapes it.

Streaming is the hot path: every request gets one SSE chunk per token, built from pre-encoded byte templates
(one concatenation a token), buffered in a list the engine appends to, and written with one ASGI send per
wake-up (several chunks at once if the client side lags, as a TCP stream would coalesce them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tuner.emulator.engine import Engine, EngineRequest, output_length
from tuner.emulator.metrics import CONTENT_TYPE, EmulatorMetrics
from tuner.emulator.tokens import OUTPUT_WORDS, chat_token_ids, text_token_ids

VLLM_VERSION = "0.11.0"  # the surface served (log shape, metric names) and the default image's
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
        "finals",
        "finish_reason",
        "first",
        "head",
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

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def on_token(self, index: int, finish_reason: str | None) -> None:
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


class _StreamResponse(Response):
    """Streams one request's SSE chunks as the engine produces them; aborts the request on disconnect."""

    def __init__(self, engine: Engine, req: EngineRequest, sink: _Sink, usage: Callable[[int], bytes] | None) -> None:
        self.engine = engine
        self.req = req
        self.sink = sink
        self.usage = usage
        self.background = None

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.sink.disconnected = True
                self.engine.abort(self.req)
                self.sink._wake()
                return

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sink = self.sink
        engine = self.engine
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        engine.submit(self.req)
        watcher = asyncio.ensure_future(self._watch(receive))
        loop = asyncio.get_running_loop()
        try:
            while True:
                buf = sink.buf
                if buf:
                    data: bytes = buf[0] if len(buf) == 1 else b"".join(buf)
                    buf.clear()
                    if sink.done:
                        if self.usage is not None:
                            data += self.usage(sink.count)
                        await send({"type": "http.response.body", "body": data + _DONE, "more_body": False})
                        return
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    continue
                if sink.cut or sink.disconnected:
                    return  # ends the response without its closing chunk: the client sees a cut stream
                fut: asyncio.Future[None] = loop.create_future()
                sink.waiter = fut
                await fut
        finally:
            watcher.cancel()
            if not sink.done:
                engine.abort(self.req)


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
        self.created = int(time.time())
        self._counter = 0
        self._id_base = os.urandom(12).hex()
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/ping", self.health, methods=["GET", "POST"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/emulator/stats", self.emulator_stats, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
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
                "running": len(self.engine.running),
                "waiting": len(self.engine.waiting),
            }
        )

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
                "permission": [],
            }
            for name in self.served_names
        ]
        return JSONResponse({"object": "list", "data": data})

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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return body

    def _model_name(self, body: dict[str, Any]) -> str:
        name = body.get("model")
        if name is None:
            return self.served_names[0]
        if name not in self.served_names:
            raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
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

    def _limits(self, body: dict[str, Any], prompt_len: int, default_max: int | None) -> tuple[int, int, bool]:
        max_tokens = self._int_field(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = self._int_field(body, "max_tokens", default_max)
        min_tokens = self._int_field(body, "min_tokens", 0) or 0
        ignore_eos = bool(body.get("ignore_eos", False))
        n = body.get("n", 1)
        if n not in (1, None):
            raise ApiError(400, "The emulator serves n=1 only.", param="n")
        mml = self.max_model_len
        if max_tokens is None:
            if prompt_len >= mml:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {mml} tokens. However, you requested "
                    f"{prompt_len} tokens in the messages, Please reduce the length of the messages.",
                )
            max_tokens = mml - prompt_len
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        if prompt_len + max_tokens > mml:
            raise ApiError(
                400,
                f"This model's maximum context length is {mml} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
            )
        if min_tokens < 0 or min_tokens > max_tokens:
            raise ApiError(
                400, f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}.", param="min_tokens"
            )
        return max_tokens, min_tokens, ignore_eos

    @staticmethod
    def _completion_prompt(body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = text_token_ids(prompt)
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
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        if (denied := self._check_auth(request)) is not None:
            return denied
        self.ensure_engine()
        try:
            body = await self._body(request)
            model = self._model_name(body)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                    raise ApiError(400, "messages must be a non-empty list of message objects.", param="messages")
                try:
                    ids = chat_token_ids(messages)
                except ValueError as e:
                    raise ApiError(400, str(e), param="messages") from None
                max_tokens, min_tokens, ignore_eos = self._limits(body, len(ids), None)
            else:
                ids = self._completion_prompt(body)
                max_tokens, min_tokens, ignore_eos = self._limits(body, len(ids), 16)
            if self.is_dead():
                raise ApiError(500, _ENGINE_DEAD, "InternalServerError")
        except ApiError as e:
            return e.response()
        seed = body.get("seed")
        target, reason = output_length(
            self.seed, ids, max_tokens, min_tokens, ignore_eos, seed if isinstance(seed, int) else None
        )
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        rid = self._next_id("chatcmpl-" if chat else "cmpl-")
        created = int(time.time())
        word0 = self._counter * 7
        prompt_len = len(ids)
        sink = self._stream_sink(rid, created, model, chat, word0) if stream else _Sink(b"", b"", {}, b"", word0)
        req = EngineRequest(rid, ids, target, reason, sink, self.engine.block_size, self.engine.caching)
        if stream:
            usage = None
            if include_usage:
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

            return _StreamResponse(self.engine, req, sink, usage)
        return await self._wait_full(req, sink, rid, created, model, chat, prompt_len)

    def _stream_sink(self, rid: str, created: int, model: str, chat: bool, word0: int) -> _Sink:
        prefix = (
            f'data: {{"id":"{rid}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
            f'"created":{created},"model":{json.dumps(model)},"choices":[{{"index":0,'
        )
        if chat:
            head = (prefix + '"delta":{"content":"').encode()
            tail = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
            finals = {
                r: f'"}},"logprobs":null,"finish_reason":"{r}","stop_reason":null}}]}}\n\n'.encode()
                for r in ("stop", "length")
            }
            first = prefix + '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            return _Sink(head, tail, finals, first.encode(), word0)
        head = (prefix + '"text":"').encode()
        tail = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        finals = {
            r: f'","logprobs":null,"finish_reason":"{r}","stop_reason":null}}]}}\n\n'.encode()
            for r in ("stop", "length")
        }
        return _Sink(head, tail, finals, b"", word0)

    async def _wait_full(
        self, req: EngineRequest, sink: _Sink, rid: str, created: int, model: str, chat: bool, prompt_len: int
    ) -> Response:
        loop = asyncio.get_running_loop()
        self.engine.submit(req)
        try:
            while not sink.done and not sink.cut:
                fut: asyncio.Future[None] = loop.create_future()
                sink.waiter = fut
                await fut
        finally:
            if not sink.done:
                self.engine.abort(req)
        if sink.cut:
            return error_response(
                500,
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "InternalServerError",
            )
        usage = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + sink.count, "completion_tokens": sink.count}
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": sink.text(), "tool_calls": []},
                "logprobs": None,
                "finish_reason": sink.finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": sink.text(),
                "logprobs": None,
                "finish_reason": sink.finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return JSONResponse(
            {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage}
        )
