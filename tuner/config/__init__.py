"""The job file: one YAML a user writes before going home. Pydantic models (extra="forbid"), loaded with errors that
name the file, the field path and what is allowed, never a traceback.

    study:    {name: my-study, storage: null}     # null: a SQLite file beside the job file
    target:   {launcher: emulator, model: llama-3.1-8b, gpu: l4, emulator: {time_scale: 20}}
    space:    {max_num_seqs: {low: 8, high: 128, log: true}, max_model_len: 8192, ...}
    workload: {input_len: 512, output_len: 128}
    arrival:  {concurrency: 16, requests: 100}
    slos:     ["e2e_p95 <= 20s", "success_rate >= 0.99"]
    objective: throughput                          # or max_rate (highest SLO-meeting request rate), goodput, cost
    budget:   {n_trials: 12, timeout: 8h}
    sampler:  {name: tpe, seed: 0}

One module a job: the shared field types (fields), the target and its launcher kinds (target), the rest of the
schema and `Job` (schema), pydantic's errors said as the file's author reads them (humanise), what pydantic cannot
see alone (checks), and the reading of a file (loader).
"""

from tuner.config.fields import parse_duration, secret_arg
from tuner.config.humanise import did_you_mean, format_validation_error
from tuner.config.loader import load_job, parse_job
from tuner.config.schema import (
    SAMPLER_NAMES,
    Budget,
    CapacitySearch,
    FeasibilitySection,
    Job,
    SamplerName,
    SamplerSection,
    StudySection,
    WorkloadSection,
    job_schema,
)
from tuner.config.target import (
    LAUNCHER_KINDS,
    DockerOptions,
    EmulatorOptions,
    LauncherOptions,
    ProcessOptions,
    TargetSection,
)

__all__ = [
    "LAUNCHER_KINDS",
    "SAMPLER_NAMES",
    "Budget",
    "CapacitySearch",
    "DockerOptions",
    "EmulatorOptions",
    "FeasibilitySection",
    "Job",
    "LauncherOptions",
    "ProcessOptions",
    "SamplerName",
    "SamplerSection",
    "StudySection",
    "TargetSection",
    "WorkloadSection",
    "did_you_mean",
    "format_validation_error",
    "job_schema",
    "load_job",
    "parse_duration",
    "parse_job",
    "secret_arg",
]
