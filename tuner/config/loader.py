"""Reading a job file: its bytes as UTF-8, its YAML (a key given twice refused, not silently the last), the
schema, then the cross-field checks; every mistake a ConfigError naming the file and the field, one line each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tuner.catalog.gpus import GpuProfile
from tuner.config.checks import job_problems
from tuner.config.humanise import field_path, format_validation_error
from tuner.config.schema import Job
from tuner.errors import ConfigError

__all__ = ["load_job", "parse_job"]


def parse_job(
    data: Any,
    *,
    where: str = "job",
    source: Path | None = None,
    stored: bool = False,
    auto_gpu: GpuProfile | None = None,
) -> Job:
    """A Job from already-parsed YAML/JSON; ConfigError naming `where`, the field path and what is allowed, one
    line per problem.

    `stored`: the job a study was run with, read back from it. Its flag keys are not checked against the pinned
    vLLM's arguments again: the vLLM the study ran accepted them, and an older study's flag (swap_space, gone from
    0.32) must not lock its own trials out of `tuner verify`, `plan` or an export. `auto_gpu`: the GPU `gpu: auto`
    stands for in the checks (Job.assume_gpu), where the job runs on other machines than this one.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a job file is a mapping with study, target, space, arrival, ...")
    try:
        job = Job.model_validate({**data, "source": source})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where, data)) from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if job.workload.dataset is not None and source is not None and not job.workload.dataset.is_absolute():
        dataset = source.parent / job.workload.dataset
        job = job.model_copy(update={"workload": job.workload.model_copy(update={"dataset": dataset})})
    if job.arrival.trace is not None and source is not None and not job.arrival.trace.is_absolute():
        trace = source.parent / job.arrival.trace
        job = job.model_copy(update={"arrival": job.arrival.model_copy(update={"trace": trace})})
    if auto_gpu is not None:
        job.assume_gpu(auto_gpu)
    problems = job_problems(job, flags=not stored)
    if problems:
        raise ConfigError("\n".join(f"{where}: {line}" for line in problems))
    return job


def _decode(p: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{p}: line {line}: byte 0x{raw[e.start]:02x} is not UTF-8; save the job file as UTF-8"
        ) from None


def _duplicates(node: Any, path: tuple[int | str, ...] = (), walked: set[int] | None = None) -> Iterator[str]:
    """`path: duplicate key` for every key given twice in one mapping: YAML would keep the last without a word."""
    walked = set() if walked is None else walked
    if id(node) in walked:
        return  # an alias of a node already walked (or of its own parent: `&a [*a]` would never end)
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key.value)
            if name in seen and name != "<<":
                yield (
                    f"{field_path((*path, name))}: duplicate key at line {key.start_mark.line + 1} (first at line "
                    f"{seen[name]}); give each key once"
                )
            seen.setdefault(name, key.start_mark.line + 1)
            yield from _duplicates(value, (*path, name), walked)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicates(item, (*path, i), walked)


def _read_yaml(p: Path, text: str) -> Any:
    try:
        duplicates = list(_duplicates(yaml.compose(text, Loader=yaml.SafeLoader)))
        if duplicates:
            raise ConfigError("\n".join(f"{p}: {line}" for line in duplicates))
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).replace("\n", " ")
        raise ConfigError(f"{p}: not valid YAML{at}: {problem}") from None


def load_job(path: str | Path, *, auto_gpu: GpuProfile | None = None) -> Job:
    """Read and validate a job file (YAML or JSON); `auto_gpu` as parse_job says."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"job file {p}: no such file") from None
    except OSError as e:
        raise ConfigError(f"job file {p}: cannot read it ({e.strerror})") from None
    data = _read_yaml(p, _decode(p, raw))
    return parse_job(data, where=str(p), source=p.resolve(), auto_gpu=auto_gpu)
