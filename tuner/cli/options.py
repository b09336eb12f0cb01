"""The options several commands take, declared once as `Annotated` aliases (a command's signature names them:
`storage: StorageOpt = None`), in three groups: where the study is (storage, --job, STUDY), how the answer is printed
(--json, --wide, -o, --html, --png), and what a deployment is made of (--trial/--best, --image, --secret-env,
--port, --name). An option one command alone takes is declared in that command's module."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.export import DEFAULT_IMAGE
from tuner.report import BEST_CHOICES

__all__ = [
    "BestOpt",
    "HtmlOpt",
    "ImageOpt",
    "JobOpt",
    "JsonOpt",
    "NameOpt",
    "OutputOpt",
    "PeakOpt",
    "PngOpt",
    "PortOpt",
    "SecretEnvOpt",
    "StorageOpt",
    "StudyArg",
    "TrialOpt",
    "WideOpt",
]

# Where the study is.
StorageOpt = Annotated[
    str | None,
    typer.Option(
        "--storage",
        envvar=["TUNER_STORAGE_URL", "TUNER_STORAGE"],
        help="Study storage URL (sqlite:///night.db, postgresql+psycopg://...). Default: the --job file's, "
        "else $TUNER_STORAGE_URL, else sqlite:///tuner.db.",
        show_default=False,
    ),
]
JobOpt = Annotated[
    Path | None,
    typer.Option("--job", help="A job file: its storage (and study name, when STUDY is left out).", show_default=False),
]
StudyArg = Annotated[
    str | None,
    typer.Argument(help="Study name (default: the --job file's, else the storage's only study).", show_default=False),
]

# How the answer is printed.
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
WideOpt = Annotated[
    bool, typer.Option("--wide", help="Every column, the flags in the table (the default fits 80 columns).")
]
OutputOpt = Annotated[
    Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.", show_default=False)
]
HtmlOpt = Annotated[
    Path | None,
    typer.Option("--html", help="Write an interactive Plotly chart here (needs tuner\\[html]).", show_default=False),
]
PngOpt = Annotated[
    Path | None, typer.Option("--png", help="Write a static PNG here (needs tuner\\[png]).", show_default=False)
]

# What a deployment is made of: the trial, its image, its secrets, its port and name.
TrialOpt = Annotated[
    int | None, typer.Option("--trial", help="This trial (a measured one) instead of --best's.", show_default=False)
]
BestOpt = Annotated[str, typer.Option("--best", help=f"Pick from the feasible front: {', '.join(BEST_CHOICES)}.")]
ImageOpt = Annotated[
    str | None,
    typer.Option(
        "--image",
        help=f"Container image. export: the server's (default: the study's, else the job's, else {DEFAULT_IMAGE}); "
        "export-workers: one with vLLM and tuner, e.g. FROM vllm/vllm-openai (-rocm on AMD) + pip install tuner "
        "(default: tuner-vllm:latest).",
        show_default=False,
    ),
]
SecretEnvOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--secret-env",
        help="A secret variable passed by name, never by value (repeatable). export: default HF_TOKEN and the job's "
        "env names; export-workers: each from the Secret's key of that name.",
        show_default=False,
    ),
]
PeakOpt = Annotated[
    float | None,
    typer.Option(
        "--peak", help="Peak requests per second: the autoscaler's maximum (with --plan).", show_default=False
    ),
]
PortOpt = Annotated[int, typer.Option("--port", help="The server's port.")]
NameOpt = Annotated[str, typer.Option("--name", help="The Compose service, Kubernetes object and Prometheus job name.")]
