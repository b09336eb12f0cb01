"""Reading a study in the morning: listings, progress, the feasible Pareto front, plots, re-scoring."""

from tuner.report.deployment import deploy_options, provenance
from tuner.report.front import BEST_CHOICES, NoFeasibleTrial, Ratios, choose, pareto_front, ratios
from tuner.report.overview import StudyListing, StudyStatus, listing, status
from tuner.report.plots import terminal_scatter, write_html, write_png
from tuner.report.rescore import RecordSource, RescoredTrial, RescoreResult, rescore
from tuner.report.storage import DEFAULT_STORAGE, STORAGE_ENV, opened_study, resolve_storage, study_names
from tuner.report.views import StudyView, TrialView, study_view, trial_view

__all__ = [
    "BEST_CHOICES",
    "DEFAULT_STORAGE",
    "STORAGE_ENV",
    "NoFeasibleTrial",
    "Ratios",
    "RecordSource",
    "RescoreResult",
    "RescoredTrial",
    "StudyListing",
    "StudyStatus",
    "StudyView",
    "TrialView",
    "choose",
    "deploy_options",
    "listing",
    "opened_study",
    "pareto_front",
    "provenance",
    "ratios",
    "rescore",
    "resolve_storage",
    "status",
    "study_names",
    "study_view",
    "terminal_scatter",
    "trial_view",
    "write_html",
    "write_png",
]
