"""The tuning study: an Optuna study whose trials launch a vLLM server with proposed flags and measure it.

Directions: maximize output tok/s, minimize the job's primary latency P95 (seconds). SLOs are Optuna constraints
(`trial.set_constraint`, <= 0 met), so `study.best_trials` is the feasible Pareto front. Trial 0 is vLLM's own defaults
(the baseline). One trial:

    suggest (vLLM's rules applied) -> claim the flag set (launched once per study, across workers)
      -> predict the start (skip what cannot start) -> launch -> load -> values + constraints -> store the detail

What a failure tells the sampler: a failed start, a crash and a predicted refusal are COMPLETE trials with the worst
values (0 tok/s, the request timeout as latency) and a positive "startup" constraint, graded by how far from starting
the flags were. TPE ranks infeasible trials by total violation into its "bad" group, NSGA-II by constrained
domination, GP models the constraint: all three then steer away from the region. A FAIL trial would be ignored by
every sampler, which keeps proposing the region that failed (auto-tuning-vllm #93). FAIL is kept for what says
nothing about the flags: a killed worker (retried once through the heartbeat) and Ctrl-C (retried on the next run).

The modules, one job each:

    objective   one trial, orchestrated            claims      never the same flags twice, across workers
    launching   launch + measure, retried once      verdict     values, constraints and the trial's record
    measure     the load phase                      trial       what the study uses of a trial; its result
    run         the study to its budget             heartbeat   a running trial's heartbeat
    samplers    the samplers by name                storage     Optuna's storage, the study's attributes
"""

from tuner.launch.factory import build_launcher
from tuner.record import OUTCOMES
from tuner.study.measure import Measure, Measurement, measure_load
from tuner.study.objective import Objective
from tuner.study.run import RunReport, TuningRun, feasible_front
from tuner.study.samplers import SAMPLERS, make_sampler
from tuner.study.storage import make_storage, study_attrs
from tuner.study.trial import TrialResult
from tuner.study.verdict import DIRECTIONS

__all__ = [
    "DIRECTIONS",
    "OUTCOMES",
    "SAMPLERS",
    "Measure",
    "Measurement",
    "Objective",
    "RunReport",
    "TrialResult",
    "TuningRun",
    "build_launcher",
    "feasible_front",
    "make_sampler",
    "make_storage",
    "measure_load",
    "study_attrs",
]
