"""Prompt fitting: learn from the server how to write prompts it can read, of an exact token length.

Before a load run, a few calls to vLLM's `/tokenize` (and `/detokenize`) find *words*: pieces of text that are one
token each, and still one token each when joined by single spaces, with their token ids. Then a completions prompt
of N tokens is N of those ids (always in the vocabulary: the server named them), and a chat prompt of N tokens is
N - k of those words, k being what the chat template adds around one user message (measured, and checked at two
lengths). Words are tried from two sources: short common English words (one token each in BPE vocabularies such
as Llama's, Qwen's, Mistral's, and in the emulator's), else the server's own vocabulary, decoded from its first
few thousand ids (word-level tokenizers, such as the tests' tiny model, where English is all `<unk>`).

A server without `/tokenize` (or whose tokenizer fits neither source) keeps the old behaviour: token ids drawn
from 1000..29999 and English words, lengths as asked but not checked (`PromptFit.exact` is False and `note`
says why).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["ENGLISH_WORDS", "UNFITTED", "PromptFit", "fit_prompts"]

# Short, common English words (at most 4 letters): one token each with a leading space in the Llama-3, Qwen and
# Mistral vocabularies, and in the emulator's stand-in tokenizer.
ENGLISH_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "be", "at", "by", "this", "had",
    "not", "but", "from", "or", "have", "an", "they", "you", "were", "her", "all", "she", "we", "him", "been",
    "has", "when", "who", "will", "more", "no", "if", "out", "so", "said", "what", "up", "its", "into", "than",
    "them", "can", "only", "new", "some", "time", "two", "may", "then", "do", "any", "my", "now", "such", "like",
    "our", "over", "man", "me", "even", "most", "made", "also", "did", "many", "must", "back", "much", "your",
    "way", "well", "down", "each", "just", "how", "too", "good", "very", "make", "own", "see", "men", "work",
    "long", "get", "here", "both", "life", "day", "same", "know", "last", "us", "old", "year", "off", "come", "go",
    "came", "used", "take",
)  # fmt: skip

_MIN_WORDS = 32
"""Fewer distinct words than this would make prompts repeat (and share prefix-cache blocks): not a fit."""
_VOCAB_PROBE = 4096
"""Ids decoded when English does not fit: enough words for any vocabulary that has them among its first ids."""
_MAX_WORDS = 2048
_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PromptFit:
    """How to write prompts for one server: token ids it accepts, words it counts one token each."""

    ids: Sequence[int]
    """Token ids for completions prompts (a prompt of N ids is N tokens)."""
    words: Sequence[str]
    """Words for chat (and dataset prefix) text: N words joined by spaces are N tokens."""
    chat_overhead: int
    """Tokens the chat template adds around one user message."""
    exact: bool
    """True when the server's tokenizer confirmed the lengths."""
    note: str
    """One line for the user: where the words came from, or why prompts are not fitted."""


UNFITTED = PromptFit(
    ids=range(1000, 30000),
    words=ENGLISH_WORDS,
    chat_overhead=0,
    exact=False,
    note="not fitted: token ids 1000..29999 and English words, lengths as asked but unchecked",
)


class _NoFit(Exception):
    pass


async def fit_prompts(client: httpx.AsyncClient, base_url: str, model: str) -> PromptFit:
    """Ask the server (`/tokenize`, `/detokenize`) for words and ids; UNFITTED, with the reason, if it cannot say.

    Never raises for what the server does: an unreachable server is the load run's to report.
    """
    tok = _Tokenizer(client, base_url.rstrip("/"), model)
    try:
        found = await _fit_words(tok, list(ENGLISH_WORDS))
        source = "English words"
        if found is None:
            found = await _fit_words(tok, await tok.vocabulary_words())
            source = "the server's vocabulary"
        if found is None:
            raise _NoFit("its tokenizer splits neither English words nor its own vocabulary one token a word")
        words, ids = found
        overhead = await _chat_overhead(tok, words)
    except _NoFit as e:
        return _unfitted(str(e))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        return _unfitted(f"/tokenize failed ({type(e).__name__}: {str(e)[:120]})")
    if overhead is None:
        return PromptFit(
            ids=ids,
            words=words,
            chat_overhead=0,
            exact=False,
            note=f"{len(words)} words from {source}; completions lengths exact, chat lengths unchecked "
            "(the chat template's length varies with the message)",
        )
    return PromptFit(
        ids=ids,
        words=words,
        chat_overhead=overhead,
        exact=True,
        note=f"fitted with /tokenize: {len(words)} words from {source}, chat template {overhead} tokens",
    )


def _unfitted(reason: str) -> PromptFit:
    return PromptFit(
        ids=UNFITTED.ids,
        words=UNFITTED.words,
        chat_overhead=0,
        exact=False,
        note=f"{UNFITTED.note} — {reason}",
    )


class _Tokenizer:
    def __init__(self, client: httpx.AsyncClient, base: str, model: str) -> None:
        self.client = client
        self.base = base
        self.model = model

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(self.base + path, json={"model": self.model, **body}, timeout=_TIMEOUT_S)
        if response.status_code != 200:
            message = _error_message(response)
            if response.status_code in (404, 405) and message is None:
                raise _NoFit(f"the server has no {path}")
            raise _NoFit(f"{path} answered HTTP {response.status_code}: {message or response.text[:160]}")
        data = response.json()
        if not isinstance(data, dict):
            raise _NoFit(f"{path} answered {str(data)[:80]}")
        return data

    async def text(self, text: str) -> list[int]:
        # Without special tokens: a completions prompt is sent as ids, so no BOS is added to it either.
        data = await self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
        return _ids(data)

    async def chat(self, content: str) -> int:
        data = await self._post("/tokenize", {"messages": [{"role": "user", "content": content}]})
        return len(_ids(data))

    async def vocabulary_words(self) -> list[str]:
        """The whitespace-separated pieces of the server's first ids, decoded (ids past the vocabulary decode empty)."""
        data = await self._post("/detokenize", {"tokens": list(range(_VOCAB_PROBE))})
        text = data.get("prompt")
        if not isinstance(text, str):
            raise _NoFit("/detokenize answered no text")
        # Markup such as <unk> or <|user|> is a special token: left out of prompts.
        pieces = [w for w in text.split() if not (w.startswith("<") and w.endswith(">"))]
        return list(dict.fromkeys(pieces))[:_MAX_WORDS]


def _error_message(response: httpx.Response) -> str | None:
    """vLLM's error message ({"error": {"message": ...}}), e.g. an unknown model's 404; None for a bare 404."""
    try:
        err = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return str(err.get("message"))[:160] if isinstance(err, dict) and err.get("message") else None


def _ids(data: dict[str, Any]) -> list[int]:
    tokens = data["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise _NoFit("/tokenize answered no token ids")
    return tokens


async def _fit_words(tok: _Tokenizer, candidates: list[str]) -> tuple[list[str], list[int]] | None:
    """The candidates that are one token each, joined by spaces, with their ids; None if too few are."""
    if not candidates:
        return None
    ids = await tok.text(" ".join(candidates))
    if len(ids) != len(candidates):
        return None
    # An id shared by several words is the unknown token: those words would all read as one.
    seen = Counter(ids)
    pairs = [(w, i) for w, i in zip(candidates, ids, strict=True) if seen[i] == 1]
    if len(pairs) < _MIN_WORDS:
        return None
    words = [w for w, _ in pairs]
    # Checked again in another order: a tokenizer that merges across spaces would count differently.
    shuffled = random.Random(0).sample(words, len(words))
    if len(await tok.text(" ".join(shuffled))) != len(words):
        return None
    return words, [i for _, i in pairs]


async def _chat_overhead(tok: _Tokenizer, words: list[str]) -> int | None:
    """Tokens the chat template adds to one user message, if the same for a short and a long message."""
    short = await tok.chat(words[0])
    many = words[: min(len(words), 64)]
    long = await tok.chat(" ".join(many))
    overhead = short - 1
    return overhead if overhead >= 0 and long - len(many) == overhead else None
