"""A deterministic stand-in for a tokenizer: counts and ids stable across runs, no vocabulary file needed.

Text is cut into words; a word is one token per 4 characters (at least one), which is close to what BPE
tokenizers give for English. Ids are a stable hash of each piece, so equal texts share prefix-cache blocks.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

_WORD = re.compile(r"\S+")

# Llama-3 chat template: <|begin_of_text|>, per message <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>,
# then the assistant header the generation starts from.
_TEMPLATE_BEGIN = [128000]
_TEMPLATE_ASSISTANT = [128006, 78191, 128007, 271]
_ROLE_IDS = {"system": 9125, "user": 882, "assistant": 78191, "tool": 14506}

OUTPUT_WORDS = (
    " the", " of", " and", " to", " a", " in", " is", " that", " for", " it", " as", " with", " was", " on",
    " be", " by", " this", " are", " or", " from", " at", " an", " which", " model", " server", " token",
    " cache", " batch", " memory", " request", " time", " GPU", " data", " each", " more", " can", " will",
    " one", " has", " not", " but", " all", " we", " they", " their", " its", " into", " than", " so",
    " when", " also", " other", " new", " some", " what", " about", " there", " up", " out", " if", " no",
    " only", " then", ".",
)  # fmt: skip


def _piece_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % 128000


_SPECIAL = {128000: "<|begin_of_text|>", 128006: "<|start_header_id|>", 128007: "<|end_header_id|>",
            128009: "<|eot_id|>", 271: "ĊĊ"}  # fmt: skip
_PIECES: dict[int, str] = {}  # id -> the piece it was made from, for /tokenize's token_strs


def token_strs(ids: list[int]) -> list[str]:
    """A string per token id: the text piece it came from where this process made it, else a placeholder."""
    return [_SPECIAL.get(i) or _PIECES.get(i) or f"<id:{i}>" for i in ids]


def _remember(piece: str) -> int:
    token = _piece_id(piece)
    if len(_PIECES) < 100_000:  # bounded: a long-running emulator must not grow without end
        _PIECES.setdefault(token, piece)
    return token


def text_token_ids(text: str) -> list[int]:
    ids: list[int] = []
    for word in _WORD.findall(text):
        if len(word) <= 4:
            ids.append(_remember(word))
        else:
            ids.extend(_remember(word[i : i + 4]) for i in range(0, len(word), 4))
    return ids


def count_text_tokens(text: str) -> int:
    return sum(max(1, -(-len(w) // 4)) for w in _WORD.findall(text))


def message_text(content: Any) -> str:
    """The text of a chat message's content: a string, or a list of parts with `text`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError("message content must be a string or a list of content parts")


def chat_token_ids(messages: list[dict[str, Any]]) -> list[int]:
    """The messages rendered through a Llama-3-shaped chat template, as token ids."""
    ids = list(_TEMPLATE_BEGIN)
    for m in messages:
        role = str(m.get("role", "user"))
        ids += [128006, _ROLE_IDS.get(role, _piece_id(role)), 128007, 271]
        ids += text_token_ids(message_text(m.get("content")))
        ids.append(128009)
    ids += _TEMPLATE_ASSISTANT
    return ids
