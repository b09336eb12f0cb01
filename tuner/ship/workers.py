"""A fleet of GPU nodes tuning one study: a Kubernetes Indexed Job of `tuner tune` workers on one PostgreSQL study.

Each pod runs `tuner tune` with the process launcher (vLLM runs inside the worker's own pod, on the GPUs the pod was
given) against the study's PostgreSQL storage, whose URL comes from a Secret by reference; Optuna's own distributed
mode and tuner's claims share the trials out. A worker that dies is restarted and the study goes on.

Built from the pieces `tuner export -f kubernetes` builds its Deployment from (tuner.export: the object name, the
GPUs' extended resource, secrets by reference), so the two manifests ask for GPUs and secrets alike.
"""

from __future__ import annotations

import re
from typing import Any

from tuner.config import Job
from tuner.errors import ConfigError
from tuner.export import K8S_GPU_RESOURCE, gpu_limits, k8s_name, secret_ref
from tuner.space import Range

__all__ = ["gpu_resource", "gpus_per_worker", "worker_manifest"]

JOB_PATH = "/etc/tuner/job.yaml"
_LABEL = re.compile(r"[^A-Za-z0-9._-]+")
# A Kubernetes extended resource: a domain-prefixed name (nvidia.com/gpu, amd.com/gpu, nvidia.com/mig-1g.10gb).
_RESOURCE = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")


def gpus_per_worker(job: Job) -> int:
    """The GPUs one trial can need: tensor x pipeline parallel size, the largest value each may take in the space."""
    n = 1
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        spec = job.space.get(name)
        if spec is None:
            continue
        values = getattr(spec, "choices", None) or ([spec.high] if isinstance(spec, Range) else [spec])
        n *= max(int(v) for v in values)
    return n


def gpu_resource(job: Job, given: str | None = None) -> str | None:
    """The resource a worker pod asks for its GPUs: `given`, else the one of the vendor of the job's GPU as the job
    resolves it (`gpu: auto`: this machine's); None for vLLM's CPU build, which needs none."""
    if given is not None:
        if not _RESOURCE.match(given):
            raise ConfigError(f"--gpu-resource {given!r}: give an extended resource name such as amd.com/gpu")
        return given
    profile = job.gpu_profile()
    return None if profile.is_cpu else K8S_GPU_RESOURCE[profile.vendor]


# one piece: the two manifests kubectl applies, read top to bottom as the YAML they become
def worker_manifest(
    job: Job,
    job_text: str,
    *,
    nodes: int,
    image: str,
    secret: str,
    secret_key: str = "url",
    secret_env: tuple[str, ...] = (),
    resource: str | None = None,
) -> list[dict[str, Any]]:
    """The ConfigMap holding the job file and the Indexed Job running `nodes` workers, one a pod. `resource`: the
    GPUs' extended resource name (default: from the job's GPU, `gpu_resource`)."""
    if job.target.launcher != "process":
        raise ConfigError(
            f"target.launcher: {job.target.launcher!r}; the cluster's workers start vLLM inside their own pod, so the "
            "job needs launcher: process (with target.process.command as the image runs vLLM)"
        )
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes}: give 1 or more")
    name = k8s_name(f"tuner-{job.study.name}", limit=52)  # room for the Job's pod suffixes
    gpus = gpus_per_worker(job)
    resource = gpu_resource(job, resource)
    labels = {"app.kubernetes.io/name": "tuner", "tuner/study": _LABEL.sub("-", job.study.name)[:63].strip("-._")}
    env: list[dict[str, Any]] = [secret_ref("TUNER_STORAGE_URL", secret, secret_key)]
    env += [secret_ref(var, secret, var) for var in secret_env]  # HF_TOKEN & co.: keys of the same Secret
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels},
        "data": {"job.yaml": job_text},
    }
    container = {
        "name": "worker",
        "image": image,
        "command": ["tuner", "tune", JOB_PATH],
        "env": env,
        **gpu_limits(resource, gpus),
        "volumeMounts": [{"name": "job", "mountPath": "/etc/tuner", "readOnly": True}],
    }
    indexed = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimitPerIndex": 3,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": [{"name": "job", "configMap": {"name": name}}],
                    # One worker a node: its GPUs are the pod's, no two workers share a node's.
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "DoNotSchedule",
                            "labelSelector": {"matchLabels": labels},
                        }
                    ],
                },
            },
        },
    }
    return [config_map, indexed]
