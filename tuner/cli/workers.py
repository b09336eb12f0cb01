"""`tuner export-workers`: the Kubernetes manifest that tunes one study on many GPU nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml

from tuner.catalog.gpus import get_gpu
from tuner.catalog.nvml import machine_devices
from tuner.cli import app
from tuner.cli.common import write_output
from tuner.cli.options import ImageOpt, OutputOpt, SecretEnvOpt
from tuner.config import Job, load_job
from tuner.errors import ConfigError, TunerError
from tuner.ship.workers import worker_manifest

__all__ = ["export_workers_cmd"]


NodesOpt = Annotated[int, typer.Option("--nodes", help="Workers to run at once: one a GPU node.")]
SecretOpt = Annotated[
    str, typer.Option("--secret", help="The Secret whose key --secret-key holds the PostgreSQL storage URL.")
]
SecretKeyOpt = Annotated[str, typer.Option("--secret-key", help="The key of the storage URL in --secret.")]
GpuResourceOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu-resource",
        help="The pods' GPU resource (default: nvidia.com/gpu or amd.com/gpu, from the vendor of target.gpu).",
        show_default=False,
    ),
]
# The workers' image runs `tuner tune`: vLLM's image with tuner installed.
WORKER_IMAGE = "tuner-vllm:latest"


@app.command("export-workers")
def export_workers_cmd(
    job_file: Annotated[Path, typer.Argument(help="The job file the workers run (target.launcher: process).")],
    nodes: NodesOpt = 2,
    image: ImageOpt = None,
    secret: SecretOpt = "tuner-storage",
    secret_key: SecretKeyOpt = "url",
    secret_env: SecretEnvOpt = None,
    gpu_resource: GpuResourceOpt = None,
    output: OutputOpt = None,
) -> None:
    """A Kubernetes Indexed Job of --nodes `tuner tune` workers, one a GPU node, on one PostgreSQL study (its URL
    from a Secret by reference), and the ConfigMap holding the job file. Each pod asks for the GPUs a trial can
    need (tensor x pipeline parallel size, the largest the space allows). `gpu: auto` is each node's to read: on a
    machine without a GPU the job is checked against an H100's figures.

    Example: [bold]tuner export-workers job.yaml --nodes 8 --image registry/tuner-vllm:0.32 --secret-env HF_TOKEN
    -o workers.yaml[/bold]
    """
    job = _job_for_the_nodes(job_file, gpu_resource)
    try:
        text = job_file.read_text(encoding="utf-8")
    except OSError as e:
        raise TunerError(f"cannot read {job_file}: {e.strerror or e}") from None
    if job.workload.dataset is not None:
        raise ConfigError("workload.dataset: a dataset file does not travel in the manifest; bake it into --image")
    docs = worker_manifest(
        job,
        text,
        nodes=nodes,
        image=image or WORKER_IMAGE,
        secret=secret,
        secret_key=secret_key,
        secret_env=tuple(secret_env or ()),
        resource=gpu_resource,
    )
    manifest = "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)
    write_output(manifest, output, f"ConfigMap, Indexed Job of {nodes} workers")


# What `gpu: auto` is checked against on a machine with no GPU of its own (the nodes read theirs).
_STAND_IN_GPU = "h100-80gb"


def _job_for_the_nodes(job_file: Path, gpu_resource: str | None) -> Job:
    """The job as the worker nodes will read it. `gpu: auto` is each node's GPU: the machine writing the manifest
    (a laptop, a CI runner) often has none, so there the rest of the job is checked against a stand-in's figures."""
    here = bool(machine_devices())
    job = load_job(job_file, auto_gpu=None if here else get_gpu(_STAND_IN_GPU))
    if job.target.gpu == "auto" and not here and gpu_resource is None:
        typer.echo(
            f"note: target.gpu auto is read on each node; this machine has no GPU, so the job was checked against "
            f"{_STAND_IN_GPU}'s figures and the pods ask for nvidia.com/gpu (--gpu-resource amd.com/gpu on AMD nodes)",
            err=True,
        )
    return job
