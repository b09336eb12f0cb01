"""What pydantic cannot see alone: the job's fields against the catalog, the pinned vLLM's arguments, the
workload's lengths, the launchers' keyword arguments and the sampler's options. Each problem is one line naming
its field."""

from __future__ import annotations

import math
from collections.abc import Iterator

from tuner.config.humanise import did_you_mean
from tuner.config.schema import Job, SamplerSection
from tuner.config.target import LAUNCHER_KINDS
from tuner.errors import ConfigError
from tuner.load.workload import FixedLength, LengthDist, UniformLength
from tuner.scoring import parse_slo
from tuner.space import KNOWN_FLAGS, Choices, Range, SearchSpace
from tuner.vllm_args import vllm_args
from tuner.vllm_pin import PINNED_VLLM

__all__ = ["job_problems"]


def _flag_problems(job: Job) -> Iterator[str]:
    """Space keys that are not arguments of the vLLM that runs, and switches given values (or the reverse)."""
    known = vllm_args()
    for name, spec in job.space.items():
        arg = known.get(name)
        if arg is None:
            dashed = "--" + name.replace("_", "-")
            yield (
                f"space.{name}: not an argument of vLLM {PINNED_VLLM}{did_you_mean(name, known)} (a flag it does "
                f"not list goes in target.{job.target.launcher}.extra_args, e.g. [{dashed}, VALUE])"
            )
            continue
        if name in KNOWN_FLAGS:
            continue  # the space checks their values itself, with what each allows
        values = (
            spec.choices if isinstance(spec, Choices) else [spec.low, spec.high] if isinstance(spec, Range) else [spec]
        )
        switch = arg.kind in ("switch", "switch_on")
        if switch and (isinstance(spec, Range) or not all(isinstance(v, bool) for v in values)):
            yield f"space.{name}: --{name.replace('_', '-')} is a switch; give true, false or choices: [true, false]"
        elif arg.kind == "switch_on" and False in values:
            yield f"space.{name}: vLLM {PINNED_VLLM} has no --no-{name.replace('_', '-')}; leave the flag out for false"
        elif not switch and any(isinstance(v, bool) for v in values):
            yield f"space.{name}: --{name.replace('_', '-')} takes a value, not true/false"


def _lower(length: int | LengthDist) -> int:
    if isinstance(length, int):
        return length
    if isinstance(length, FixedLength):
        return length.value
    return length.low if isinstance(length, UniformLength) else length.min


def _largest_model_len(space: SearchSpace) -> tuple[int, str] | None:
    """The longest max_model_len any trial gets, and how the job gives it (None when left to vLLM)."""
    fixed = space.fixed.get("max_model_len")
    if isinstance(fixed, int):
        return fixed, f"max_model_len {fixed}"
    dist = space.distributions.get("max_model_len")
    if dist is None:
        return None
    values = [int(c) for c in getattr(dist, "choices", ()) if isinstance(c, int | float)]
    high = max(values) if values else int(getattr(dist, "high", 0))
    return high, f"every max_model_len of the space (the largest is {high})"


def _length_problems(job: Job, space: SearchSpace) -> Iterator[str]:
    """A max_model_len that no request of the workload fits in: every trial fails every request."""
    w = job.workload
    largest = _largest_model_len(space)
    if job.arrival.trace is not None:
        if largest is not None:
            yield from _too_many_too_long(job, *largest)
        return
    if w.dataset is not None or largest is None:
        return  # a dataset's lengths are estimated, and vLLM's own default is the model's limit (checked there)
    shortest = max(_lower(w.input_len), w.prefix_len + 1) + _lower(w.output_len)
    limit, said = largest
    if shortest > limit:
        slo = next((s for s in job.slos if parse_slo(s).metric == "success_rate"), None)
        verdict = f"no trial can meet {slo!r}" if slo else "no request can succeed"
        yield (
            f"space.max_model_len: {said} is shorter than every request of the workload (at least {shortest} "
            f"tokens: input_len + output_len): vLLM refuses or cuts them all and {verdict}; raise max_model_len to at "
            f"least {w.max_request_tokens()} or shorten workload.input_len/output_len"
        )
        return
    yield from _too_many_too_long(job, limit, said)


# Requests drawn to judge a duration-bound run (whose count is not known before it runs).
_LENGTH_SAMPLE = 1000


def _too_many_too_long(job: Job, limit: int, said: str) -> Iterator[str]:
    """Some requests longer than every max_model_len: an error only where they alone miss the success-rate SLO (the
    run's own requests, drawn by its seed, counted); fewer stay the space's note."""
    rate = next((parse_slo(s) for s in job.slos if parse_slo(s).metric == "success_rate"), None)
    if rate is None or rate.op != ">=":
        return
    n = (job.arrival.requests or _LENGTH_SAMPLE) + job.arrival.warmup_requests
    if job.arrival.trace is not None:
        totals = [r.input_len + r.output_len for r in job.arrival.trace_requests()][job.arrival.warmup_requests :]
    else:
        totals = job.workload.request_tokens(n)[job.arrival.warmup_requests :]
    too_long = sum(t > limit for t in totals)
    allowed = math.floor(len(totals) * (1 - rate.threshold) + 1e-9)
    if too_long <= allowed:
        return
    needed = sorted(totals)[len(totals) - allowed - 1]
    if job.arrival.trace is not None:
        whose, how, fix = "the trace slice's", "its input + output lengths", "cut a slice without them"
    else:
        whose, how = "the workload's", "input_len + output_len, as its seed draws them"
        fix = "shorten workload.input_len/output_len"
    yield (
        f"space.max_model_len: {said} is shorter than {too_long} of {whose} {len(totals)} measured requests "
        f"({how}): vLLM refuses or cuts those, so no trial can meet '{rate}'; raise max_model_len to at least "
        f"{needed} or {fix}"
    )


def _launcher_option_problems(job: Job) -> Iterator[str]:
    """`target.<kind>.options` reach the launcher as keyword arguments: a key it does not take would fail every
    trial at its first launch, so it is named here, with the keys it does take (its kind's registered keywords)."""
    for kind, options in LAUNCHER_KINDS.items():
        allowed = sorted(options.keywords)
        given: dict[str, object] = getattr(job.target.section(kind), "options", {})
        for key in given:
            if key not in allowed:
                yield (
                    f"target.{kind}.options.{key}: not an option of the {kind} launcher; allowed: "
                    f"{', '.join(allowed)}{did_you_mean(key, allowed)}"
                )


def _objective_problems(job: Job) -> Iterator[str]:
    """A goodput objective judges each request by the latency SLOs' bounds: without one there is nothing to judge."""
    if job.objective == "goodput" and not any(s.is_latency and s.op in ("<=", "<") for s in job.parsed_slos()):
        yield (
            "objective: goodput needs a latency SLO to judge each request by (an upper bound on ttft, tpot, e2e or "
            "itl, e.g. 'ttft_p95 <= 2s'); slos has none"
        )
    if job.objective == "cost":
        yield from _cost_problems(job)


def _cost_problems(job: Job) -> Iterator[str]:
    """The cost objective sizes a deployment for the job's load within its SLOs: both must be given."""
    if job.cost_load() is None:
        yield (
            "objective: cost serves the job's load, given as arrival.rate (requests/s) or arrival.concurrency "
            "(users); a trace's load is its own: use objective: throughput, or give a rate"
        )
    if not job.parsed_slos():
        yield "objective: cost finds each shape's capacity within the SLOs; slos is empty (e.g. 'e2e_p95 <= 10s')"


def _trace_problem(job: Job) -> str | None:
    """A trace that cannot be read, a slice with no request in it, or what a trace replaces given beside it."""
    a = job.arrival
    try:
        requests = a.trace_requests()
    except ConfigError as e:
        return f"arrival.trace: {e}"
    if not requests:
        end = f"{a.start_s + a.duration_s:g}" if a.duration_s is not None else "its end"
        span = a.load_trace().requests[-1].t_s
        return f"arrival: the trace's slice from {a.start_s:g} s to {end} holds no request (the trace spans {span:g} s)"
    if job.workload.dataset is not None:
        return "workload.dataset: a trace gives each request's lengths; leave out workload.dataset or arrival.trace"
    if job.objective in ("max_rate", "goodput") and a.trace_rate() is None:
        at = f"at {requests[0].send_s:g} s" if len(requests) > 1 else "in it"
        return (
            f"objective: {job.objective} plays the trace faster or slower to each rate it tries, and the slice has "
            f"{'one request' if len(requests) == 1 else 'every request ' + at}: give a slice of requests at two "
            "times at least, or objective: throughput"
        )
    return None


def job_problems(job: Job, *, flags: bool = True) -> list[str]:
    """Everything pydantic cannot see alone: the catalog, the space against the model, vLLM (`flags`: the keys
    against its arguments) and the workload."""
    try:
        job.gpu_profile()
    except ConfigError as e:
        return [f"target.gpu: {e}"]
    try:
        job.model_profile()
    except ConfigError as e:
        return [f"target.model: {e}"]
    try:
        job.step_profile()
    except ConfigError as e:
        return [f"target.profile: {e}"]
    try:
        job.workload.max_request_tokens()  # reads a dataset: a missing or broken one is the workload's problem
    except ConfigError as e:
        return [f"workload.dataset: {e}"]
    if job.arrival.trace is not None and (trace_problem := _trace_problem(job)) is not None:
        return [trace_problem]
    problems = [*_objective_problems(job), *(_flag_problems(job) if flags else ())]
    try:
        space = job.search_space()
    except ConfigError as e:
        return [*problems, *str(e).splitlines()]
    problems += _length_problems(job, space)
    problems += _launcher_option_problems(job)
    problems += _sampler_problems(job.sampler)
    if job.sampler.name == "grid" and not problems:
        try:
            space.grid()
        except ConfigError as e:
            problems.append(str(e))
    return problems


# The options only TPE reads (the twin hands over to TPE, and a job without a name gets twin or tpe).
_TPE_OPTIONS = ("multivariate", "group")


def _sampler_problems(s: SamplerSection) -> list[str]:
    problems = [
        f"sampler.{option}: only tpe and twin (its TPE fallback) take it; sampler.name is {s.name}"
        for option in _TPE_OPTIONS
        if getattr(s, option) is not None and s.name not in (None, "tpe", "twin")
    ]
    if s.group and s.multivariate is False:
        problems.append("sampler.group: needs multivariate (true or left out); give group: false or drop it")
    return problems
