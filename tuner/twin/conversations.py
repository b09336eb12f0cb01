"""A conversation workload's users in the twin's virtual time: each holds one conversation, sends a turn once its
previous answer is in and its think time has passed, and carries its history as token ids, so the engine's prefix
cache finds every earlier turn's prompt as the emulator's (and vLLM's) does.

The answers' ids are made up: the engine does not keep the ids it generates, so (as in the emulator) an answer's
blocks are not served from the cache, only the prompts before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from tuner.load.conversation import Conversation, Turn
from tuner.load.workload import PromptSpec, Workload

__all__ = ["ConversationUsers"]

# The Llama-3-shaped template's tokens around a message (as tuner.emulator.tokens renders it): a header of
# 4 before it, an end-of-turn after it, and the assistant header a generation starts from.
_HEADER = 4
_CHARS_PER_TOKEN = 4.0


@dataclass
class _User:
    turns: tuple[Turn, ...] = ()
    next: int = 0
    history: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    ready_at: float = 0.0
    busy: bool = False


class ConversationUsers:
    """`users` users of `workload` (a conversation workload): whose turn is due, and the turn's prompt ids."""

    def __init__(self, workload: Workload, users: int) -> None:
        self.source: Iterator[Conversation] = workload.conversation_source()
        self.from_file = workload.dataset is not None
        self.users = [_User() for _ in range(users)]
        self._ids = itertools.count(1_000_000)  # apart from every id the twin's other prompts use
        self._system: dict[str, list[int]] = {}

    def due(self, now: float) -> list[int]:
        """The users with no request in flight whose think time is over."""
        return [u for u, s in enumerate(self.users) if not s.busy and s.ready_at <= now + 1e-12]

    def next_wake(self) -> float:
        """When the next idle user's think time ends (inf: every user waits for an answer)."""
        return min((s.ready_at for s in self.users if not s.busy), default=float("inf"))

    def next_turn(self, user: int) -> PromptSpec:
        s = self.users[user]
        if s.next >= len(s.turns):
            self._start(s, next(self.source))
        turn = s.turns[s.next]
        prompt = [*s.history, *self._fresh(_HEADER + self._tokens(turn.message) + 1), *self._fresh(_HEADER)]
        s.pending = [*prompt, *self._fresh(turn.output_len + 1)]
        s.busy = True
        return PromptSpec(prompt=prompt, prompt_len=len(prompt), output_len=turn.output_len, turn=s.next)

    def finished(self, user: int, ok: bool, now: float) -> None:
        """The user's answer is in (`ok`) or its turn failed, which ends its conversation."""
        s = self.users[user]
        s.busy = False
        if ok:
            s.history, s.next = s.pending, s.next + 1
        else:
            s.next = len(s.turns)
        s.ready_at = now + (s.turns[s.next].think_s if s.next < len(s.turns) else 0.0)

    def _start(self, s: _User, conversation: Conversation) -> None:
        s.turns, s.next = conversation.turns, 0
        s.history = [128000]  # the template's begin-of-text
        if conversation.system:
            # The same system text is the same ids in every conversation: its blocks are shared, as a server sees.
            system = self._system.setdefault(conversation.system, self._fresh(self._tokens(conversation.system)))
            s.history += [0] * _HEADER + system + [0]

    def _tokens(self, text: str) -> int:
        # Made-up messages are words of one token each; a file's text is ~4 characters a token.
        return max(1, round(len(text) / _CHARS_PER_TOKEN)) if self.from_file else len(text.split())

    def _fresh(self, n: int) -> list[int]:
        return [next(self._ids) for _ in range(n)]
