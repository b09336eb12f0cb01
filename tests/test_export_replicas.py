"""Exports of a box of replicas, read back as their consumer reads them: each replica on GPUs of its own, on a port of
its own; one replica written exactly as a lone server always was."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex

import pytest
import yaml

from tuner.errors import ConfigError
from tuner.export import DeployOptions, render, replica_devices
from tuner.flags import VllmFlags

TP2 = VllmFlags(max_num_seqs=64, max_model_len=4096, tensor_parallel_size=2)
ONE = DeployOptions(model="meta-llama/Llama-3.1-8B-Instruct", image="vllm/vllm-openai:v0.11.0")
BOX = dataclasses.replace(ONE, replicas=4)  # 8 GPUs at tensor parallel 2


def gpu_sets(lists: list[str]) -> list[set[int]]:
    return [{int(i) for i in devices.split(",")} for devices in lists]


def assert_disjoint_box(sets: list[set[int]], replicas: int, world: int) -> None:
    assert len(sets) == replicas and all(len(s) == world for s in sets)
    assert set().union(*sets) == set(range(replicas * world))  # every GPU once: disjoint and none left out


def test_replica_devices_are_disjoint_runs() -> None:
    assert replica_devices(4, 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert replica_devices(2, 4) == ["0,1,2,3", "4,5,6,7"]
    assert replica_devices(3, 1) == ["0", "1", "2"]


def test_vllm_serve_lines_one_per_replica_on_own_gpus_and_ports() -> None:
    text = render("vllm-args", TP2, BOX)
    serves = [line for line in text.splitlines() if "vllm serve" in line]
    assert len(serves) == 4
    devices, ports = [], []
    for line in serves:
        words = shlex.split(line)
        assert words[0].startswith("CUDA_VISIBLE_DEVICES=") and words[-1] == "&"
        devices.append(words[0].split("=", 1)[1])
        ports.append(int(words[words.index("--port") + 1]))
        assert words[words.index("--tensor-parallel-size") + 1] == "2"
    assert_disjoint_box(gpu_sets(devices), 4, 2)
    assert ports == [8000, 8001, 8002, 8003]
    assert text.rstrip().endswith("wait")
    assert "4 replicas x 2 GPUs" in text


def test_compose_has_a_service_per_replica_with_disjoint_device_ids() -> None:
    doc = yaml.safe_load(render("compose", TP2, BOX))
    services = doc["services"]
    assert list(services) == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
    ids, host_ports = [], []
    for service in services.values():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device  # compose refuses a count beside device_ids
        ids.append(",".join(device["device_ids"]))
        (mapping,) = service["ports"]
        host, container = mapping.split(":")
        assert container == "8000"
        host_ports.append(int(host))
    assert_disjoint_box(gpu_sets(ids), 4, 2)
    assert len(set(host_ports)) == 4


def test_docker_runs_one_named_container_a_replica() -> None:
    text = render("docker", TP2, BOX)
    runs = re.findall(r"docker run -d --name (\S+) --runtime nvidia --gpus (\S+)", text)
    assert [name for name, _ in runs] == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
    # docker wants the comma list inside double quotes, which the shell passes on: `--gpus '"device=0,1"'`
    devices = [shlex.split(gpus)[0].strip('"').removeprefix("device=") for _, gpus in runs]
    assert_disjoint_box(gpu_sets(devices), 4, 2)
    assert sorted(re.findall(r"-p (\d+):8000", text)) == ["8000", "8001", "8002", "8003"]


def test_amd_replicas_are_given_their_gpus_through_hip() -> None:
    box = dataclasses.replace(BOX, gpu_vendor="amd")
    serves = [shlex.split(line)[0] for line in render("vllm-args", TP2, box).splitlines() if "vllm serve" in line]
    assert all(word.startswith("HIP_VISIBLE_DEVICES=") for word in serves)
    services = yaml.safe_load(render("compose", TP2, box))["services"].values()
    assert_disjoint_box(gpu_sets([s["environment"]["HIP_VISIBLE_DEVICES"] for s in services]), 4, 2)


def test_kubernetes_deployment_at_the_box_replicas_each_pod_one_replicas_gpus() -> None:
    docs = list(yaml.safe_load_all(render("kubernetes", TP2, BOX)))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 4
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_json_lists_each_replica() -> None:
    doc = json.loads(render("json", TP2, BOX))
    replicas = doc["replicas"]
    assert [r["port"] for r in replicas] == [8000, 8001, 8002, 8003]
    assert_disjoint_box(gpu_sets([r["CUDA_VISIBLE_DEVICES"] for r in replicas]), 4, 2)


def test_config_usage_starts_each_replica_on_its_port() -> None:
    text = render("vllm-config", TP2, BOX)
    usage = re.findall(r"CUDA_VISIBLE_DEVICES=(\S+) vllm serve --config vllm-config.yaml --port (\d+)", text)
    assert [int(p) for _, p in usage] == [8000, 8001, 8002, 8003]
    assert_disjoint_box(gpu_sets([d for d, _ in usage]), 4, 2)
    assert yaml.safe_load(text)["tensor-parallel-size"] == 2


@pytest.mark.parametrize("fmt", ["vllm-args", "vllm-config", "docker", "compose", "kubernetes", "json", "python"])
def test_one_replica_is_written_as_a_lone_server(fmt: str) -> None:
    text = render(fmt, TP2, ONE)
    assert "replicas x" not in text and "VISIBLE_DEVICES" not in text
    assert render(fmt, TP2, dataclasses.replace(ONE, replicas=1)) == text


def test_one_replica_serve_line_is_unchanged() -> None:
    text = render("vllm-args", TP2, ONE)
    assert text == "vllm serve meta-llama/Llama-3.1-8B-Instruct " + shlex.join(TP2.to_args()) + "\n"


@pytest.mark.parametrize("replicas", [0, -1])
def test_no_replicas_is_refused(replicas: int) -> None:
    with pytest.raises(ConfigError, match="replicas"):
        dataclasses.replace(ONE, replicas=replicas)
