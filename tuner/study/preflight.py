"""A study that cannot measure stops at once and says why.

Before the first trial's load, a few probe requests of the job's own workload go to that trial's server (the
baseline's, so no start-up is spent on the check): each must succeed, its `usage.prompt_tokens` must be the prompt
length the workload meant and its `completion_tokens` the pinned output length. A refusal that no flag can change (an
HTTP 4xx such as a chat request to a model without a chat template, token ids outside the vocabulary, an API key the
server wants; a reply shorter than pinned while max_model_len is not a flag the study can raise) stops the study
before the budget is touched, with one message: what was sent, what the server answered, what to change in the job.

The same judgement is made of every trial's load (`workload_fault`): when every request failed with the same
client-side refusal, the trial says nothing about its flags and the study stops instead of learning "infeasible".
What the flags can cause (time-outs under load, 5xx, a crash, a 429, a length refusal under a max_model_len the study
tunes) is never called the workload's: the sampler keeps learning from it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx
from optuna.distributions import CategoricalDistribution, IntDistribution
from pydantic import BaseModel

from tuner.clock import Clock
from tuner.config import Job
from tuner.errors import TunerError
from tuner.flags import VllmFlags, resolve
from tuner.launch import Server
from tuner.load import PromptSpec, RequestRecord
from tuner.load.client import send_request
from tuner.load.prompt_fit import PromptFit, fit_prompts
from tuner.load.runner import new_client

__all__ = [
    "CHAT_SLACK",
    "INVALID",
    "PROBES",
    "Check",
    "Preflight",
    "PreflightResult",
    "WorkloadRejected",
    "api_key_advice",
    "check_workload",
    "judge_probes",
    "workload_fault",
]

PROBES = 3
"""Probe requests: enough to see that the answer is not one request's accident, a few seconds on any server."""
CHAT_SLACK = 2
"""Prompt tokens a chat prompt may differ by from the fitted length: a template that joins the message's first or
last word to its own markup counts one token less or more at each end. Completions prompts (token ids) are exact."""
_PROBE_SEED = 7919
"""Added to the workload's seed: the probes are drawn like the load's requests but are not its first ones, so they
leave nothing in the prefix cache that the measured load would hit."""
INVALID = "the workload is invalid for this server"
_NOT_CLIENT_SIDE = (408, 429)  # a time-out and a rate limit are the server's capacity, not the request's fault
_LENGTH_WORDS = ("maximum context length", "max_model_len", "max_tokens", "input_tokens")


class WorkloadRejected(TunerError):
    """The server refuses the job's requests whatever the flags: the study stops with this one-line message."""

    def __init__(self, detail: str, reason: str) -> None:
        super().__init__(f"{INVALID}: {detail}")
        self.reason = reason  # the failure class: http_4xx, short_output, prompt_length


@dataclass(frozen=True)
class PreflightResult:
    passed: bool  # False: inconclusive (the server failed in a way the flags may cause); the trial measures as usual
    note: str


Check = Callable[[Server, Job, VllmFlags], Awaitable[PreflightResult]]


@dataclass
class Preflight:
    """Runs `check` on the servers of a run's trials until one passes; a rejection raises `WorkloadRejected`."""

    check: Check
    on_event: Callable[[str], None]
    passed: bool = False

    async def run(self, server: Server, job: Job, flags: VllmFlags, number: int) -> None:
        if self.passed:
            return
        result = await self.check(server, job, flags)
        self.passed = result.passed
        self.on_event(f"trial {number}: preflight {'passed' if result.passed else 'inconclusive'}: {result.note}")


async def check_workload(
    server: Server, job: Job, flags: VllmFlags, *, client: httpx.AsyncClient | None = None
) -> PreflightResult:
    """Send `PROBES` requests of the job's workload to `server`, one at a time, and judge them (see the module)."""
    http = client or new_client()
    try:
        fit = await fit_prompts(http, server.base_url, server.model) if _fitted(job) else None
        workload = job.workload.model_copy(update={"seed": job.workload.seed + _PROBE_SEED})
        prompts = workload.prompts(fit)
        clock = Clock(server.time_scale)
        url = server.base_url.rstrip("/") + workload.path
        probes: list[tuple[PromptSpec, RequestRecord]] = []
        for index in range(PROBES):
            spec = next(prompts)
            record = await send_request(
                http,
                url,
                workload.body(server.model, spec),
                clock=clock,
                timeout_s=float(job.request_timeout),
                index=index,
                origin=clock.now(),
                chat=workload.api == "chat",
                expect_output=spec.output_len,
            )
            probes.append((spec, record))
            if not record.ok:
                break  # one answer is enough to judge; the next ones would say the same
    finally:
        if client is None:
            await http.aclose()
    return judge_probes(job, flags, server.model, probes, fit)


def _fitted(job: Job) -> bool:
    # As the load does: a dataset's text goes as it is; only made-up tokens need the server's tokenizer.
    return job.workload.dataset is None or job.workload.prefix_len > 0


def judge_probes(
    job: Job, flags: VllmFlags, model: str, probes: Sequence[tuple[PromptSpec, RequestRecord]], fit: PromptFit | None
) -> PreflightResult:
    """The verdict on the probes: passed, inconclusive, or `WorkloadRejected` raised."""
    for spec, record in probes:
        if not record.ok:
            refusal = _refusal(job, flags, record)
            if refusal is None:
                return PreflightResult(False, f"{_sent(job, model, spec)} failed: {record.error_message}")
            detail = f"{_sent(job, model, spec)} {_answered(record)} — in the job: {refusal}"
            raise WorkloadRejected(detail, _reason(record))
        wrong = _wrong_length(job, spec, record, fit)
        if wrong is not None:
            raise WorkloadRejected(f"{_sent(job, model, spec)} {wrong}", "prompt_length")
    checked = "prompt and output lengths as meant" if _lengths_checked(job, fit) else "output lengths as pinned"
    if not _lengths_checked(job, fit):
        checked += f" (prompt lengths unchecked: {_unchecked_why(job, fit)})"
    return PreflightResult(True, f"{len(probes)} probe requests answered, {checked}")


def workload_fault(job: Job, flags: VllmFlags, records: Sequence[RequestRecord]) -> WorkloadRejected | None:
    """A trial's load in which every request failed with the same refusal no flag can change, as the study's stop."""
    if not records or any(r.ok for r in records):
        return None
    first = records[0]
    if any(r.error_class != first.error_class for r in records):
        return None
    advice = _refusal(job, flags, first)
    if advice is None:
        return None
    sent = f"every one of the trial's {len(records)} requests ({_sent(job, None, None)})"
    return WorkloadRejected(f"{sent} {_answered(first)} — in the job: {advice}", _reason(first))


def _refusal(job: Job, flags: VllmFlags, record: RequestRecord) -> str | None:
    """What to change in the job when `record` is a refusal no flag can change; None when the flags may cause it."""
    message = (record.error_message or "").lower()
    if record.error_class == "short_output" or (
        record.error_class == "http_4xx" and any(w in message for w in _LENGTH_WORDS)
    ):
        if not _length_is_the_jobs(job, flags):
            return None  # this trial's max_model_len, a flag the study tunes: the sampler learns from it
        longest = job.longest_request()
        return (
            f"prompt + output must fit max_model_len: give space.max_model_len at least {longest} (the workload's "
            "longest request), or shorten workload.input_len / workload.output_len"
        )
    if record.error_class != "http_4xx" or _status(record) in _NOT_CLIENT_SIDE:
        return None
    return _advice(job, record, message)


def _advice(job: Job, record: RequestRecord, message: str) -> str:
    kind = job.target.launcher
    if _status(record) in (401, 403):
        return api_key_advice(job, os.environ)
    if "chat template" in message:
        return (
            "workload.api: chat needs a chat template and this model has none: use workload.api: completions, or a "
            f"model that has one (or --chat-template FILE in target.{kind}.extra_args)"
        )
    if "out of vocabulary" in message:
        return (
            "the prompts' token ids are outside the model's vocabulary (the server's /tokenize did not fit them): "
            "use workload.api: chat, or a dataset (workload.dataset)"
        )
    if _status(record) == 404 or "does not exist" in message:
        return f"the server does not serve the model the load asks for: check {_model_names(job)}"
    return "change the workload (workload.*) or the target so that the server accepts these requests"


_KEY_ENV = "VLLM_API_KEY"
# The load sends no Authorization header and no job setting gives it one: the only fix is a server without a key.
_NO_KEY_IN_LOAD = "the load sends no API key (no job setting passes one to it)"


def api_key_advice(job: Job, environment: Mapping[str, str]) -> str:
    """Where the key the server wants came from, as far as the job and `environment` show, and how to drop it."""
    kind = job.target.launcher
    found = _api_key_sources(job, environment)
    if not found:
        return (
            f"the server wants an API key and {_NO_KEY_IN_LOAD}; nothing in target.{kind} sets one (no --api-key, "
            f"no {_KEY_ENV} passed), so the server's own image or configuration does: start it without a key"
        )
    where = "; ".join(f"{source}: {fix}" for source, fix in found)
    return f"the server wants an API key and {_NO_KEY_IN_LOAD}; {where}"


def _api_key_sources(job: Job, environment: Mapping[str, str]) -> list[tuple[str, str]]:
    """(where a key the server was given came from, how to drop it), in the order the job shows them."""
    kind, found = job.target.launcher, []
    if kind == "process":
        p = job.target.process
        if any(part.split("=", 1)[0] == "--api-key" for part in p.command):
            found.append(("--api-key is in target.process.command", "drop it from the command"))
        if _KEY_ENV in p.options.get("env", {}):
            found.append((f"target.process.options.env sets {_KEY_ENV}", "remove it there"))
        elif _KEY_ENV in environment:
            found.append(
                (
                    f"{_KEY_ENV} is set in the environment `tuner tune` runs in, which the server inherits",
                    "unset it there (listing it in target.process.env only hides its value)",
                )
            )
    elif kind == "docker" and _KEY_ENV in job.target.docker.env and _KEY_ENV in environment:
        found.append((f"target.docker.env passes {_KEY_ENV} to the container", f"remove {_KEY_ENV} from that list"))
    return found


def _model_names(job: Job) -> str:
    """The job's settings that name the model the server serves, for the launcher it uses."""
    kind = job.target.launcher
    section = job.target.section(kind)
    names = ["target.model"]
    if kind != "emulator":  # the emulator serves target.model itself: it has no model_id nor options
        names += [f"target.{kind}.model_id", f"target.{kind}.options.served_model_name"]
    args = [*getattr(section, "extra_args", []), *(job.target.process.command if kind == "process" else [])]
    if any(a.split("=", 1)[0] == "--served-model-name" for a in args):
        where = "command or extra_args" if kind == "process" else "extra_args"
        names.append(f"--served-model-name in target.{kind}.{where}")
    return ", ".join(names)


def _length_is_the_jobs(job: Job, flags: VllmFlags) -> bool:
    """True when no max_model_len the study may try is longer than this trial's: a length refusal is then the job's."""
    dist = job.search_space().distributions.get("max_model_len")
    if isinstance(dist, IntDistribution):
        highest = dist.high
    elif isinstance(dist, CategoricalDistribution):
        highest = max(int(c) for c in dist.choices if isinstance(c, int))
    else:
        return True  # fixed, or vLLM's default (the model's own limit): no trial has more
    return resolve(flags, job.gpu_profile(), job.model_profile()).max_model_len >= highest


def _wrong_length(job: Job, spec: PromptSpec, record: RequestRecord, fit: PromptFit | None) -> str | None:
    if not record.usage_from_server:
        return None  # no usage to check against: the load counts streamed tokens then, as it always has
    if record.completion_tokens != spec.output_len:
        return (
            f"answered {record.completion_tokens} output tokens where max_tokens {spec.output_len} with ignore_eos "
            "pins them; this server does not honour ignore_eos, so the load cannot pin output lengths"
        )
    if not _lengths_checked(job, fit):
        return None
    slack = CHAT_SLACK if job.workload.api == "chat" else 0
    if abs(record.prompt_tokens - spec.prompt_len) <= slack:
        return None
    assert fit is not None
    return (
        f"was counted {record.prompt_tokens} prompt tokens by the server where the workload meant {spec.prompt_len} "
        f"(slack {slack}; prompt fit: {fit.note}): use workload.api: completions, whose token-id prompts are exact"
    )


def _lengths_checked(job: Job, fit: PromptFit | None) -> bool:
    # A conversation's prompt holds the server's own answers, whose length as text is the tokenizer's, not pinned.
    return fit is not None and fit.exact and job.workload.dataset is None and job.workload.conversations is None


def _unchecked_why(job: Job, fit: PromptFit | None) -> str:
    if job.workload.dataset is not None:
        return "a dataset's prompt lengths are estimated from their characters"
    return fit.note if fit is not None else "no prompt fit"


def _status(record: RequestRecord) -> int | None:
    match = re.match(r"HTTP (\d{3})", record.error_message or "")
    return int(match.group(1)) if match else None


def _reason(record: RequestRecord) -> str:
    return record.error_class or "other"


def _sent(job: Job, model: str | None, spec: PromptSpec | None) -> str:
    w = job.workload
    target = f"model {model!r}, " if model else ""
    if spec is None:
        return f"POST {w.path}, {target}input_len {_length(w.input_len)}, output_len {_length(w.output_len)}"
    prompt = "token ids" if isinstance(spec.prompt, list) else "text"
    return f"POST {w.path} ({target}a {spec.prompt_len}-token prompt as {prompt}, max_tokens {spec.output_len})"


def _length(value: object) -> str:
    if isinstance(value, BaseModel):
        return " ".join(f"{k}={v}" for k, v in value.model_dump().items() if v is not None)
    return str(value)


def _answered(record: RequestRecord) -> str:
    if record.error_class == "short_output":
        return f"was answered short: {record.error_message}"
    return f"was answered {record.error_message}"
