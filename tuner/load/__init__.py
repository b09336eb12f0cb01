"""The load phase: an async streaming load generator measuring what vLLM users measure.

`run_load` sends a workload on a closed or open loop and scores it; `find_max_rate` searches the highest
request rate that meets the SLOs.
"""

from tuner.load.arrival import Arrival
from tuner.load.capacity_search import find_max_rate
from tuner.load.results import (
    FAILURE_CLASSES,
    CapacitySearchResult,
    CapacityStep,
    LoadResult,
    RequestRecord,
    ServerMetricsSummary,
)
from tuner.load.runner import LoadProgress, run_load
from tuner.load.server_metrics import diagnose, parse_metrics
from tuner.load.workload import (
    FixedLength,
    LogNormalLength,
    NormalLength,
    PromptSpec,
    UniformLength,
    Workload,
)

__all__ = [
    "FAILURE_CLASSES",
    "Arrival",
    "CapacitySearchResult",
    "CapacityStep",
    "FixedLength",
    "LoadProgress",
    "LoadResult",
    "LogNormalLength",
    "NormalLength",
    "PromptSpec",
    "RequestRecord",
    "ServerMetricsSummary",
    "UniformLength",
    "Workload",
    "diagnose",
    "find_max_rate",
    "parse_metrics",
    "run_load",
]
