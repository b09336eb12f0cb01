"""Multi-turn conversations: what each user says, turn by turn, and how long it thinks between turns.

`workload.conversations` describes them (turns, think time, each new message's length, each answer's length), or
`workload.dataset` names a multi-turn ShareGPT file whose human turns are said in order. The load runner sends each
turn through the chat API with the whole conversation so far (every earlier message and the server's own answers)
plus the new message, once the previous answer is in and the think time has passed; a conversation keeps its user
to its end. A server with prefix caching then finds every later turn's history in its cache, as it does for chat
users and agents.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuner.errors import ConfigError
from tuner.load.lengths import LengthDist, as_dist
from tuner.load.prompt_fit import PromptFit
from tuner.load.results import RequestRecord, TurnFigures
from tuner.scoring import percentile

__all__ = [
    "Conversation",
    "ConversationSpec",
    "ExponentialSeconds",
    "LogNormalSeconds",
    "SecondsDist",
    "Turn",
    "UniformSeconds",
    "load_sharegpt_conversations",
    "turn_figures",
]

# Without a tokenizer, a text's length is estimated at ~4 characters a token (as the dataset workload does).
_CHARS_PER_TOKEN = 4.0
_CHARS_PER_TOKEN_BOUND = 3.0
# A chat template's own tokens per message (role headers, end-of-turn): an allowance for the longest request.
_TEMPLATE_TOKENS_PER_MESSAGE = 8


class UniformSeconds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dist: Literal["uniform"] = "uniform"
    low: float = Field(ge=0)
    high: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> UniformSeconds:
        if self.high < self.low:
            raise ValueError(f"uniform think_s: high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


class ExponentialSeconds(BaseModel):
    """Exponential with the given mean: a user who may answer at once or after a long pause."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dist: Literal["exponential"] = "exponential"
    mean: float = Field(gt=0)
    max: float | None = Field(default=None, gt=0)

    def sample(self, rng: random.Random) -> float:
        v = rng.expovariate(1.0 / self.mean)
        return min(v, self.max) if self.max is not None else v


class LogNormalSeconds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)
    max: float | None = Field(default=None, gt=0)

    def sample(self, rng: random.Random) -> float:
        v = rng.lognormvariate(math.log(self.median), self.sigma)
        return min(v, self.max) if self.max is not None else v


SecondsDist = Annotated[UniformSeconds | ExponentialSeconds | LogNormalSeconds, Field(discriminator="dist")]
PositiveCount = Annotated[int, Field(ge=1)]


class ConversationSpec(BaseModel):
    """`workload.conversations`: each a number of turns, a think time before every turn after the first, the new
    message's length and the answer's length (tokens, or the length distributions of input_len/output_len)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    turns: PositiveCount | LengthDist = Field(default=4, description="turns per conversation")
    think_s: Annotated[float, Field(ge=0)] | SecondsDist = Field(
        default=0.0, description="seconds between an answer and the user's next message"
    )
    input_len: PositiveCount | LengthDist = Field(default=128, description="tokens of each new user message")
    output_len: PositiveCount | LengthDist = Field(default=128, description="tokens of each answer")
    system_len: Annotated[int, Field(ge=0)] = Field(
        default=0, description="tokens of a system prompt shared by every conversation (0: none)"
    )

    def think(self, rng: random.Random) -> float:
        return float(self.think_s) if isinstance(self.think_s, int | float) else self.think_s.sample(rng)

    def describe(self) -> str:
        """One line for the dry run, e.g. 'conversations of up to 6 turns, think time exponential'."""
        think = f"{self.think_s:g} s" if isinstance(self.think_s, int | float) else self.think_s.dist
        system = f", a {self.system_len}-token system prompt" if self.system_len else ""
        return f"conversations of up to {as_dist(self.turns).upper} turns, think time {think}{system}"

    def longest_conversation_tokens(self) -> int:
        """Prompt + output tokens of the last turn of the longest conversation this spec can draw."""
        turns = as_dist(self.turns).upper
        per_turn = as_dist(self.input_len).upper + as_dist(self.output_len).upper + 2 * _TEMPLATE_TOKENS_PER_MESSAGE
        return self.system_len + _TEMPLATE_TOKENS_PER_MESSAGE + turns * per_turn


@dataclass(frozen=True)
class Turn:
    message: str
    output_len: int
    think_s: float
    """Seconds the user waits after the previous answer before sending this turn (0 for the first)."""


@dataclass(frozen=True)
class Conversation:
    system: str | None
    turns: tuple[Turn, ...]


def synthetic_conversations(spec: ConversationSpec, fit: PromptFit, seed: int) -> Iterator[Conversation]:
    """The endless, reproducible sequence of made-up conversations, written in `fit`'s words (one token each)."""
    rng = random.Random(seed)  # lengths, turns and think times: the same for every server
    words = random.Random(f"conversation-words-{seed}")
    turns, n_in, n_out = as_dist(spec.turns), as_dist(spec.input_len), as_dist(spec.output_len)
    system = " ".join(words.choice(fit.words) for _ in range(spec.system_len)) if spec.system_len else None
    while True:
        count = turns.sample(rng)
        drawn = []
        for i in range(count):
            length, out = n_in.sample(rng), n_out.sample(rng)
            think = spec.think(rng) if i else 0.0
            drawn.append(Turn(" ".join(words.choice(fit.words) for _ in range(length)), out, think))
        yield Conversation(system, tuple(drawn))


def dataset_conversations(
    spec: ConversationSpec, rows: Sequence[tuple[tuple[str, int], ...]], seed: int
) -> Iterator[Conversation]:
    """The file's conversations, shuffled afresh on every pass (seeded); think times drawn from the spec."""
    rng = random.Random(seed)
    order = list(rows)
    while True:
        rng.shuffle(order)
        for row in order:
            turns = tuple(Turn(text, out, spec.think(rng) if i else 0.0) for i, (text, out) in enumerate(row))
            yield Conversation(None, turns)


_sharegpt_cache: dict[tuple[str, float, int], tuple[tuple[tuple[str, int], ...], ...]] = {}


def load_sharegpt_conversations(path: Path) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Each conversation of a ShareGPT JSON file as (human message, answer length in tokens) pairs, in order."""
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime, st.st_size)
        if key not in _sharegpt_cache:
            _sharegpt_cache[key] = _read_sharegpt(path, path.read_text(encoding="utf-8", errors="replace"))
    except OSError as e:
        raise ConfigError(f"dataset {path}: cannot read it ({e.strerror})") from None
    return _sharegpt_cache[key]


def _read_sharegpt(path: Path, text: str) -> tuple[tuple[tuple[str, int], ...], ...]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"dataset {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise ConfigError(f"dataset {path}: a conversation workload needs a ShareGPT JSON list of conversations")
    out = []
    for i, item in enumerate(data):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            raise ConfigError(
                f"dataset {path}: entry {i} has no 'conversations' list (ShareGPT: [{{from: human|gpt, value}}])"
            )
        pairs = _pairs(turns)
        if pairs:
            out.append(pairs)
    if not out:
        raise ConfigError(f"dataset {path}: no conversation with a human turn followed by a gpt answer")
    return tuple(out)


def _pairs(turns: list[object]) -> tuple[tuple[str, int], ...]:
    """(human message, answer tokens) for every human turn answered by gpt; a system turn or a dangling human turn
    at the end is left out (the server writes the answers; only their lengths come from the file)."""
    pairs: list[tuple[str, int]] = []
    pending: str | None = None
    for t in turns:
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            continue
        who = t.get("from")
        if who in ("human", "user") and t["value"].strip():
            pending = t["value"]
        elif who in ("gpt", "assistant", "chatgpt") and pending is not None:
            pairs.append((pending, max(1, round(len(t["value"]) / _CHARS_PER_TOKEN))))
            pending = None
    return tuple(pairs)


def longest_dataset_tokens(rows: Sequence[tuple[tuple[str, int], ...]]) -> int:
    """The last turn of the longest conversation in the file: every message, every answer and the template."""
    return max(
        sum(math.ceil(len(text) / _CHARS_PER_TOKEN_BOUND) + out + 2 * _TEMPLATE_TOKENS_PER_MESSAGE for text, out in row)
        for row in rows
    )


def turn_figures(records: Sequence[RequestRecord]) -> TurnFigures | None:
    """TTFT of the conversations' first turns against their later ones (measured, successful requests); None when
    the run was not a conversation workload."""
    turns = [r for r in records if r.turn is not None and not r.warmup]
    if not turns:
        return None
    first = [r.ttft_s for r in turns if r.turn == 0 and r.ok and r.ttft_s is not None]
    later = [r.ttft_s for r in turns if r.turn and r.ok and r.ttft_s is not None]
    return TurnFigures(
        first_turns=sum(1 for r in turns if r.turn == 0),
        later_turns=sum(1 for r in turns if r.turn),
        ttft_p50_first_s=percentile(first, 50) if first else None,
        ttft_p95_first_s=percentile(first, 95) if first else None,
        ttft_p50_later_s=percentile(later, 50) if later else None,
        ttft_p95_later_s=percentile(later, 95) if later else None,
        max_turn=max(r.turn for r in turns if r.turn is not None),
    )
