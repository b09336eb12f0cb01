"""The optional parts of tuner (pyproject's extras) a command needs, checked before it runs: a missing one is one
line naming the extra to install (`pip install 'tuner[postgres]'`), exit 2, never the import's traceback."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass

from tuner.config import Job
from tuner.errors import ConfigError
from tuner.store import safe_url

__all__ = [
    "EXTRAS",
    "Extra",
    "extra_for_module",
    "installed",
    "need_extra",
    "need_job_extras",
    "need_plot_extras",
    "need_storage_driver",
]


@dataclass(frozen=True)
class Extra:
    name: str  # as pyproject.toml's [project.optional-dependencies] names it
    modules: tuple[str, ...]  # what it installs, as imported
    purpose: str

    @property
    def install(self) -> str:
        return f"pip install 'tuner[{self.name}]'"


EXTRAS: dict[str, Extra] = {
    e.name: e
    for e in (
        Extra("postgres", ("psycopg",), "PostgreSQL storage: postgresql+psycopg://..."),
        Extra("html", ("plotly",), "HTML plots: --html"),
        Extra("png", ("matplotlib",), "PNG plots: --png"),
        Extra("gp", ("torch", "scipy"), "the GP sampler: sampler.name gp"),
        Extra("gpu", ("pynvml",), "NVIDIA GPUs read through NVML: target.gpu auto"),
    )
}


def installed(module: str) -> bool:
    """Whether `module` would import, without importing it (torch takes seconds)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: an import refused (as a test simulates a missing module)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def need_extra(name: str, what: str) -> None:
    """ConfigError naming the extra when a module of it is missing; `what` is what needed it (`--html`)."""
    extra = EXTRAS[name]
    missing = [m for m in extra.modules if not installed(m)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"{what} needs {' and '.join(missing)}, which {verb} not installed: {extra.install}")


def extra_for_module(module: str) -> Extra | None:
    """The extra that installs `module` (or the package it is part of), if one does."""
    top = module.split(".")[0]
    return next((e for e in EXTRAS.values() if top in e.modules), None)


# SQLAlchemy drivers whose import name is not their package's (the rest install under the module's own name).
_PACKAGE_OF_MODULE = {"MySQLdb": "mysqlclient", "psycopg2": "psycopg2-binary"}


def need_storage_driver(url: str) -> None:
    """The storage URL's database driver importable, checked before a study opens (and by `tune --dry-run`): without
    it Optuna says `Failed to import DB access module` and exits 1 mid-way."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        dialect = make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError):
        return  # not a URL, or no such database kind: the storage's own check says so, with what is allowed
    try:
        dialect.import_dbapi()
    except ImportError as e:
        module = e.name or dialect.driver
        extra = extra_for_module(module)
        if extra is not None:
            fix = extra.install
        elif dialect.name == "postgresql":
            fix = f"use postgresql+psycopg://... and {EXTRAS['postgres'].install}"
        else:  # a database tuner's extras do not cover: the driver's package, where its name is not the module's
            fix = f"pip install {_PACKAGE_OF_MODULE.get(module, module)}"
        raise ConfigError(f"storage {safe_url(url)}: its database driver {module} is not installed: {fix}") from None


def need_job_extras(job: Job, url: str) -> None:
    """What a study of `job` in `url` imports beyond the base install: the storage's driver, GP's torch."""
    need_storage_driver(url)
    if job.sampler.name == "gp":
        need_extra("gp", "sampler.name: gp")


def need_plot_extras(html: object | None, png: object | None) -> None:
    """--html's plotly and --png's matplotlib, checked before the study is read."""
    if html is not None:
        need_extra("html", "--html")
    if png is not None:
        need_extra("png", "--png")
