"""The card comparison as text for an 80-column terminal: the ranking marked as the twin's predictions, each card's
flag set below it, what the ranking is by, and the card to confirm on real hardware."""

from __future__ import annotations

import shlex
import textwrap
from collections.abc import Sequence

from tuner.ship.cards import CardPlan, by_cost

__all__ = ["comparison_lines"]

WIDTH = 80
_HEAD = f"{'rank':>4} {'card':<14} {'shape':<6} {'req/s/srv':>9} {'tok/s/srv':>9} {'servers':>7} {'GPUs':>5}"
_HEAD += f" {'$/hour':>8} {'$/M tok':>8}"


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _shape(p: CardPlan) -> str:
    flags = p.pick.flags
    if flags is None:
        return "—"
    tp = max(1, flags.tensor_parallel_size)
    pp = flags.world_size // tp
    return f"TP{tp}" + (f"xPP{pp}" if pp > 1 else "")


def _row(rank: int, p: CardPlan) -> str:
    pick = p.pick
    tok_s = pick.capacity_rps * pick.tokens_per_request if pick.capacity_rps and pick.tokens_per_request else None
    return (
        f"{rank:>4} {pick.card:<14.14} {_shape(p):<6} {_num(pick.capacity_rps, ',.2f'):>9} {_num(tok_s, ',.0f'):>9} "
        f"{_num(p.servers, 'd'):>7} {_num(p.gpus, 'd'):>5} {_num(p.usd_per_hour, ',.2f'):>8} "
        f"{_num(p.usd_per_m_tokens, ',.3f'):>8}"
    )


def _wrapped(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent + "  ", break_on_hyphens=False)


def comparison_lines(
    plans: Sequence[CardPlan], *, rate: float, headroom: float, slos: Sequence[str], command: str
) -> list[str]:
    """The table and what to read it with. `command` is the `tuner tune` line that confirms the top card."""
    out = _wrapped(
        f"PREDICTED by the twin (the catalog's figures for each card, no server started), for {rate:g} req/s at "
        f"headroom {headroom:g} under {', '.join(slos)}:",
        "",
    )
    out += [_HEAD, "-" * len(_HEAD)]
    out += [_row(i, p) for i, p in enumerate(plans, 1)]
    out += _wrapped("each card's best flag set (req/s/srv: one server's highest rate meeting the SLOs):", "")
    for p in plans:
        pick = p.pick
        what = shlex.join(pick.flags.to_args()) if pick.flags is not None else f"none: {pick.why}"
        out += _wrapped(f"  {pick.card}: {what} ({pick.tried} flag sets probed)", "  ")
    out += _ranking(plans)
    top = next((p for p in plans if p.gpus is not None), None)
    if top is None:
        out += _wrapped("No card met the SLOs in the twin; loosen the SLOs or widen the space.", "")
        return out
    out += _wrapped(
        f"These are predictions: confirm {top.pick.card} on the real card before buying it, e.g. {command} on an "
        f"{top.pick.card} (target.gpu: {top.pick.card}), then `tuner plan --measure`.",
        "",
    )
    return out


def _priced(plans: Sequence[CardPlan]) -> list[str]:
    """`h100-80gb 3.348, l40s 1.332 (where both are listed)`: each source named once, after its cards."""
    by_source: dict[str, list[str]] = {}
    for p in plans:
        if p.price is not None:
            by_source.setdefault(p.price_source or "given", []).append(f"{p.pick.card} {p.price:g}")
    return [f"{', '.join(cards)} ({source})" for source, cards in by_source.items()]


def _ranking(plans: Sequence[CardPlan]) -> list[str]:
    priced = _priced(plans)
    if by_cost(plans):
        return _wrapped("ranked by $/hour for the load; USD per GPU-hour: " + ", ".join(priced) + ".", "")
    missing = [p.pick.card for p in plans if p.price is None and p.gpus is not None]
    hint = ",".join(f"{card}=USD" for card in missing)
    text = "ranked by GPUs needed (then req/s a GPU): "
    text += f"no price for {', '.join(missing)}; give --gpu-hour-usd {hint} to rank by cost" if missing else ""
    text += " (the catalog cites no price for them)." if missing else "."
    if priced:
        text += " Priced: " + ", ".join(priced) + "."
    return _wrapped(text, "")
