"""What the load phase sends: prompt/output lengths (fixed, drawn, or from a dataset) and the request bodies.

Synthetic prompts go to /v1/completions as token ids, or to /v1/chat/completions as words, both drawn from a
`PromptFit` (tuner.load.prompt_fit) that the server's tokenizer confirmed, so their lengths are exact as the server
counts them; the output length is fixed with max_tokens + ignore_eos. One seed fixes the whole request
sequence: the lengths alone (whatever the server), and the tokens given the fit.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from tuner.errors import ConfigError
from tuner.load.conversation import (
    Conversation,
    ConversationSpec,
    dataset_conversations,
    load_sharegpt_conversations,
    longest_dataset_tokens,
    synthetic_conversations,
)
from tuner.load.jsonl import json_lines
from tuner.load.lengths import Dist as _Dist
from tuner.load.lengths import (
    FixedLength,
    LengthDist,
    LogNormalLength,
    NormalLength,
    UniformLength,
)
from tuner.load.lengths import as_dist as _dist
from tuner.load.prompt_fit import UNFITTED, PromptFit

__all__ = [
    "ChatApi",
    "FixedLength",
    "LengthDist",
    "LogNormalLength",
    "NormalLength",
    "PromptSpec",
    "UniformLength",
    "Workload",
    "load_dataset",
]

# Without a tokenizer, text lengths are estimated: ~4 characters a token (OpenAI's rule of thumb) for typical
# text; the bound used for max_request_tokens is the more cautious 3.
_CHARS_PER_TOKEN = 4.0
_CHARS_PER_TOKEN_BOUND = 3.0


ChatApi = Literal["completions", "chat"]


@dataclass(frozen=True)
class PromptSpec:
    """One request to send: the body fields that vary, and the lengths it is meant to have."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    messages: tuple[dict[str, str], ...] | None = None
    """A conversation's turn: the whole conversation so far and the new message (the body's messages)."""
    turn: int | None = None


@dataclass(frozen=True)
class _DatasetRow:
    prompt: str
    output_len: int | None


class Workload(BaseModel):
    """Lengths, prompt source and API of the requests; a seed makes the sequence reproducible."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_len: int | LengthDist = 512
    output_len: int | LengthDist = 128
    dataset: Path | None = None
    """JSONL of {"prompt"|"text": ..., "output_len"|"output_length": ...} (output optional) or ShareGPT JSON;
    replaces input_len."""
    api: ChatApi = "completions"
    prefix_len: int = Field(default=0, ge=0)
    """Tokens at the start of every prompt that are shared by all requests (exercises prefix caching)."""
    conversations: ConversationSpec | None = None
    """Multi-turn conversations through the chat API (tuner.load.conversation); with `dataset`, a ShareGPT file's
    human turns in order."""
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> Workload:
        if self.conversations is not None:
            _check_conversations(self)
            return self
        if self.prefix_len and self.dataset is None and self.prefix_len >= _dist(self.input_len).upper:
            raise ValueError(f"prefix_len ({self.prefix_len}) must be shorter than the longest prompt")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A workload without conversations dumps as before they existed: its fingerprint, the stored job and the
        # twin's seed (a digest of the dump) stay what they were.
        # A conversation workload dumps only what it uses, so that its dump (the stored job) reads back.
        data: dict[str, Any] = handler(self)
        if self.conversations is None:
            data.pop("conversations", None)
        else:
            for unused in ("input_len", "output_len", "prefix_len"):
                data.pop(unused, None)
            data["api"] = "chat"
        return data

    def _input(self) -> _Dist:
        return _dist(self.input_len)

    def _output(self) -> _Dist:
        return _dist(self.output_len)

    @property
    def is_chat(self) -> bool:
        return self.api == "chat" or self.conversations is not None

    def max_request_tokens(self) -> int:
        """The longest prompt + output this workload can send (estimated from characters for text datasets)."""
        if self.conversations is not None:
            if self.dataset is not None:
                return longest_dataset_tokens(load_sharegpt_conversations(self.dataset))
            return self.conversations.longest_conversation_tokens()
        if self.dataset is not None:
            rows = load_dataset(self.dataset)
            return max(
                math.ceil(len(r.prompt) / _CHARS_PER_TOKEN_BOUND)
                + self.prefix_len
                + (r.output_len or self._output().upper)
                for r in rows
            )
        return max(self._input().upper, self.prefix_len + 1) + self._output().upper

    def request_tokens(self, n: int) -> list[int]:
        """Prompt + output tokens of the first `n` synthetic requests, as the seed draws them for every run (a chat
        template's few tokens not counted); not for a dataset, whose lengths are only estimated."""
        if self.conversations is not None:
            return [p.prompt_len + p.output_len for p in itertools.islice(self.prompts(), n)]
        rng = random.Random(self.seed)  # the same draws, in the same order, as prompts()
        lengths = []
        for _ in range(n):
            n_in = max(self._input().sample(rng), self.prefix_len + 1)
            lengths.append(n_in + self._output().sample(rng))
        return lengths

    def fingerprint(self) -> str:
        """A stable hash of everything that decides the request sequence (dataset contents included)."""
        h = hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode())
        if self.dataset is not None:
            try:
                h.update(self.dataset.read_bytes())
            except OSError as e:
                raise ConfigError(f"dataset {self.dataset}: cannot read it ({e.strerror})") from None
        return h.hexdigest()[:16]

    def prompts(self, fit: PromptFit | None = None) -> Iterator[PromptSpec]:
        """The endless, reproducible request sequence, written with `fit`'s ids and words (default: unfitted)."""
        fit = fit or UNFITTED
        if self.conversations is not None:
            # Made-up messages are in the fit's words, one token each; a dataset's text is estimated.
            count = _estimate if self.dataset is not None else _count_words
            yield from _turns_offline(self.conversation_source(fit), fit, count)
            return
        rng = random.Random(self.seed)
        # Tokens from their own generator: the lengths are the same for every server, whatever its vocabulary.
        tokens = random.Random(f"tokens-{self.seed}")
        if self.dataset is not None:
            yield from self._dataset_prompts(rng, fit, tokens)
            return
        if self.api == "completions":
            prefix_ids = draws(tokens, fit.ids, self.prefix_len)
            while True:
                n_in = max(self._input().sample(rng), self.prefix_len + 1)
                n_out = self._output().sample(rng)
                # Each prompt is drawn afresh, so no two share more than a chance first token or two (beyond the
                # shared prefix): the prefix cache cannot serve them.
                ids = prefix_ids + draws(tokens, fit.ids, n_in - self.prefix_len)
                yield PromptSpec(prompt=ids, prompt_len=n_in, output_len=n_out)
        prefix_words = draws(tokens, fit.words, self.prefix_len)
        while True:
            n_in = max(self._input().sample(rng), self.prefix_len + 1)
            n_out = self._output().sample(rng)
            # The chat template's own tokens count: a prompt shorter than it plus one word cannot be had.
            n_words = max(n_in - fit.chat_overhead, self.prefix_len + 1)
            words = prefix_words + draws(tokens, fit.words, n_words - self.prefix_len)
            yield PromptSpec(prompt=" ".join(words), prompt_len=n_words + fit.chat_overhead, output_len=n_out)

    def conversation_source(self, fit: PromptFit | None = None) -> Iterator[Conversation]:
        """The endless, reproducible sequence of conversations (a conversation workload only)."""
        assert self.conversations is not None
        if self.dataset is not None:
            return dataset_conversations(self.conversations, load_sharegpt_conversations(self.dataset), self.seed)
        return synthetic_conversations(self.conversations, fit or UNFITTED, self.seed)

    def _dataset_prompts(self, rng: random.Random, fit: PromptFit, tokens: random.Random) -> Iterator[PromptSpec]:
        assert self.dataset is not None
        rows = list(load_dataset(self.dataset))
        prefix = " ".join(tokens.choice(fit.words) for _ in range(self.prefix_len))
        overhead = fit.chat_overhead if self.api == "chat" else 0
        while True:
            rng.shuffle(rows)
            for row in rows:
                text = f"{prefix} {row.prompt}" if prefix else row.prompt
                n_out = row.output_len if row.output_len is not None else self._output().sample(rng)
                est = max(1, round(len(row.prompt) / _CHARS_PER_TOKEN)) + self.prefix_len + overhead
                yield PromptSpec(prompt=text, prompt_len=est, output_len=n_out)

    def body(self, model: str, spec: PromptSpec) -> dict[str, Any]:
        """The JSON body of one streamed request (vLLM's ignore_eos pins the output length at max_tokens).

        No min_tokens, as `vllm bench serve` sends none: vLLM 0.32 shortens max_tokens to fit max_model_len, and then
        rejects a min_tokens above it with a 400 that blames min_tokens; without it the reply comes back short
        (finish_reason "length") and the client names it for what it is, `short_output`.
        """
        common: dict[str, Any] = {
            "model": model,
            "max_tokens": spec.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.messages is not None:
            return {**common, "messages": list(spec.messages)}
        if self.api == "completions":
            return {**common, "prompt": spec.prompt}
        return {**common, "messages": [{"role": "user", "content": spec.prompt}]}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.is_chat else "/v1/completions"


T = TypeVar("T")


def draws(rng: random.Random, items: Sequence[T], n: int) -> list[T]:
    """`[rng.choice(items) for _ in range(n)]`: the same draws (CPython's choice of a Random is an index from
    `getrandbits`, redrawn while out of range), in one frame, not three, a token. A twin's simulation draws every
    token of every prompt: a dry run's reachability sweep, 48 flag sets of 620 prompts of 1,024 tokens, spent a
    third of its time in choice."""
    size = len(items)
    if n > 0 and not size:
        raise IndexError("Cannot choose from an empty sequence")
    bits, k = rng.getrandbits, size.bit_length()
    out = []
    for _ in range(n):
        r = bits(k)
        while r >= size:
            r = bits(k)
        out.append(items[r])
    return out


def _check_conversations(w: Workload) -> None:
    """The fields a conversation workload takes from `conversations` instead: one clear line for each clash."""
    given = w.model_fields_set
    if "api" in given and w.api != "chat":
        raise ValueError("conversations are sent through the chat API: leave out api or give api: chat")
    for name in ("input_len", "output_len", "prefix_len"):
        if name in given:
            where = "system_len" if name == "prefix_len" else name
            raise ValueError(f"with conversations, give {where} under conversations, not workload.{name}")
    if w.dataset is not None:
        spec = w.conversations
        assert spec is not None
        for name in ("turns", "input_len", "output_len"):
            if name in spec.model_fields_set:
                raise ValueError(f"conversations.{name} comes from the dataset's conversations: leave it out")


def _turns_offline(
    conversations: Iterator[Conversation], fit: PromptFit, count: Callable[[str], int]
) -> Iterator[PromptSpec]:
    """Every turn of every conversation in order, each with its history, the answers stood in for by `output_len`
    words (their text is the server's): the requests of one user with no server to answer, for the twin and the
    length checks. The runner sends the server's own answers instead."""
    overhead = fit.chat_overhead or 4
    words = random.Random("conversation-answers")
    for conv in conversations:
        history: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
        tokens = count(conv.system or "") + overhead if conv.system else 0
        for i, turn in enumerate(conv.turns):
            messages = (*history, {"role": "user", "content": turn.message})
            tokens += count(turn.message) + overhead
            yield PromptSpec(turn.message, tokens, turn.output_len, messages=messages, turn=i)
            answer = " ".join(words.choice(fit.words) for _ in range(turn.output_len))
            history = [*messages, {"role": "assistant", "content": answer}]
            tokens += turn.output_len + overhead


def _count_words(text: str) -> int:
    return len(text.split())


def _estimate(text: str) -> int:
    return max(1, round(len(text) / _CHARS_PER_TOKEN))


_dataset_cache: dict[tuple[str, float, int], tuple[_DatasetRow, ...]] = {}


def load_dataset(path: Path) -> tuple[_DatasetRow, ...]:
    """Rows of a JSONL prompt file or a ShareGPT JSON file; one clear ConfigError for anything else."""
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"dataset {path}: cannot read it ({e.strerror})") from None
    key = (str(path.resolve()), st.st_mtime, st.st_size)
    if key not in _dataset_cache:
        _dataset_cache[key] = _read_dataset(path)
    return _dataset_cache[key]


def _read_dataset(path: Path) -> tuple[_DatasetRow, ...]:
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    rows: list[_DatasetRow] = []
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"dataset {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        for i, item in enumerate(data):
            row = _sharegpt_row(item) if isinstance(item, dict) and "conversations" in item else _jsonl_row(item)
            if row is None:
                raise ConfigError(f"dataset {path}: entry {i} has no prompt (ShareGPT 'conversations' or 'prompt')")
            rows.append(row)
    else:
        for lineno, item in json_lines(path, text, "dataset"):
            row = _jsonl_row(item)
            if row is None:
                raise ConfigError(
                    f"dataset {path}: line {lineno} needs a string 'prompt' or 'text' (optional integer 'output_len')"
                )
            rows.append(row)
    rows = [r for r in rows if r.prompt]
    if not rows:
        raise ConfigError(f"dataset {path}: no prompts in it (JSONL with 'prompt' per line, or ShareGPT JSON)")
    return tuple(rows)


_PROMPT_KEYS = ("prompt", "text")  # ours, and AIPerf's single_turn files
_OUTPUT_KEYS = ("output_len", "output_length", "output_tokens", "max_tokens")


def _jsonl_row(item: object) -> _DatasetRow | None:
    if not isinstance(item, dict):
        return None
    prompt = next((item[k] for k in _PROMPT_KEYS if isinstance(item.get(k), str)), None)
    if prompt is None:
        return None
    out = next((item[k] for k in _OUTPUT_KEYS if k in item), None)
    return _DatasetRow(prompt=prompt, output_len=out if isinstance(out, int) and out > 0 else None)


def _sharegpt_row(item: dict[str, Any]) -> _DatasetRow | None:
    turns = item.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None
    first = turns[0]
    if not isinstance(first, dict) or not isinstance(first.get("value"), str):
        return None
    out: int | None = None
    if len(turns) > 1 and isinstance(turns[1], dict) and isinstance(turns[1].get("value"), str):
        out = max(1, round(len(turns[1]["value"]) / _CHARS_PER_TOKEN))
    return _DatasetRow(prompt=first["value"], output_len=out)
