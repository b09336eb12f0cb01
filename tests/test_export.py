"""Exports are checked by reading them back the way their consumer would: a shell, YAML, JSON, Python."""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import shlex
from typing import Any

import pytest
import yaml

import tuner.export as export
from tuner.catalog import get_gpu, load_model
from tuner.errors import ConfigError
from tuner.export import DEFAULT_IMAGE, FORMATS, DeployOptions, Provenance, container_args, export_format, render
from tuner.flags import VllmFlags, default_flags

TUNED = VllmFlags(
    max_num_seqs=192,
    max_model_len=8192,
    gpu_memory_utilization=0.93,
    max_num_batched_tokens=4096,
    enable_prefix_caching=False,
    enable_chunked_prefill=True,
)
WIDE = VllmFlags(
    max_num_seqs=64,
    max_model_len=4096,
    tensor_parallel_size=2,
    kv_cache_dtype="fp8",
    block_size=32,
    enforce_eager=True,
    extra={"swap_space": 8, "disable_log_requests": True, "chat_template": "/tmp/my template's.jinja"},
)
OPTIONS = DeployOptions(model="meta-llama/Llama-3.1-8B-Instruct", image="vllm/vllm-openai:v0.11.0")
PROV = Provenance(
    study="h100-night",
    trial=17,
    image="vllm/vllm-openai:v0.11.0",
    gpu="h100-80gb",
    model="llama-3.1-8b",
    workload_hash="a1b2c3d4e5f6",
    output_tok_s=10234.5,
    objective_latency_s=2.345,
    latency_metric="e2e_p95",
    latencies={"e2e_p95": 2.345, "ttft_p95": 0.456},
    success_rate=1.0,
    slos=("e2e_p95<=3s", "success_rate>=0.99"),
    tuner_version="0.1.0",
    exported_at=dt.datetime(2026, 12, 2, 7, 30, tzinfo=dt.UTC),
)


def vllm_parser() -> argparse.ArgumentParser:
    """An independent reading of the flags, with vLLM's option names and kinds."""
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--model")
    p.add_argument("--served-model-name")
    p.add_argument("--port", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--swap-space", type=int)
    p.add_argument("--disable-log-requests", action=argparse.BooleanOptionalAction)
    p.add_argument("--chat-template")
    return p


def flags_from(args: list[str]) -> tuple[dict[str, Any], VllmFlags]:
    ns = vars(vllm_parser().parse_args(args))
    meta = {k: ns.pop(k) for k in ("model", "served_model_name", "port")}
    extra = {k: ns.pop(k) for k in ("swap_space", "disable_log_requests", "chat_template") if ns[k] is not None}
    for k in ("swap_space", "disable_log_requests", "chat_template"):
        ns.pop(k, None)
    return meta, VllmFlags(**{k: v for k, v in ns.items() if v is not None}, extra=extra)


def shell_words(text: str) -> list[str]:
    """What a POSIX shell would run: comments dropped, line continuations joined."""
    return shlex.split(text.replace("\\\n", " "), comments=True)


@pytest.mark.parametrize("flags", [TUNED, WIDE], ids=["tuned", "wide"])
def test_vllm_serve_line_round_trips_through_shlex(flags: VllmFlags) -> None:
    text = render("vllm-args", flags, OPTIONS, PROV)
    words = shell_words(text)
    assert words[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    _, back = flags_from(words[3:])
    assert back == flags
    # one command line, after the comments
    assert [line for line in text.splitlines() if not line.startswith("#")] == [shlex.join(words)]


def test_baseline_flags_round_trip_and_say_baseline() -> None:
    flags = default_flags(get_gpu("h100-80gb"), load_model("llama-3.1-8b"))
    prov = Provenance(study="s", trial=0, baseline=True)
    text = render("vllm-args", flags, OPTIONS, prov)
    assert "baseline" in text.splitlines()[0]
    assert flags_from(shell_words(text)[3:])[1] == flags


def test_quoting_survives_awkward_model_paths() -> None:
    options = DeployOptions(model="/models/my model's dir", served_model_name="llama 8b")
    for fmt in ("vllm-args", "docker"):
        words = shell_words(render(fmt, WIDE, options))
        meta, back = flags_from(words[words.index(DEFAULT_IMAGE) + 1 :] if fmt == "docker" else words[3:])
        assert back == WIDE
        assert meta["served_model_name"] == "llama 8b"
    assert shell_words(render("vllm-args", WIDE, options))[2] == "/models/my model's dir"


def test_provenance_comments_name_everything() -> None:
    head = [line for line in render("vllm-args", TUNED, OPTIONS, PROV).splitlines() if line.startswith("#")]
    text = "\n".join(head)
    for needle in (
        "h100-night",
        "trial 17",
        "vllm/vllm-openai:v0.11.0",
        "h100-80gb",
        "llama-3.1-8b",
        "a1b2c3d4e5f6",
        "10,234.5 output tok/s",
        "P95 2.345 s",
        "2026-12-02 07:30 UTC",
        "e2e_p95<=3s",
    ):
        assert needle in text, needle


def test_provenance_with_newlines_stays_in_comments() -> None:
    prov = Provenance(study="evil\nrm -rf /", trial=1, gpu="h100\n--enforce-eager")
    for fmt in ("vllm-args", "docker"):
        text = render(fmt, TUNED, OPTIONS, prov)
        assert "rm" not in shell_words(text)
        assert flags_from(shell_words(text)[-len(TUNED.to_args()) :])[1] == TUNED


def test_docker_line_has_gpus_ipc_cache_and_token_by_name() -> None:
    text = render("docker", TUNED, OPTIONS, PROV)
    words = shell_words(text)
    assert words[:2] == ["docker", "run"]
    assert "--gpus" in words and words[words.index("--gpus") + 1] == "all"
    assert "--ipc=host" in words
    volume = words[words.index("-v") + 1]
    assert volume.endswith(":/root/.cache/huggingface") and volume.startswith("$HOME/")
    assert words[words.index("-e") + 1] == "HF_TOKEN"
    assert words[words.index("-p") + 1] == "8000:8000"
    image_at = words.index("vllm/vllm-openai:v0.11.0")
    meta, back = flags_from(words[image_at + 1 :])
    assert back == TUNED and meta["model"] == OPTIONS.model
    # the cache path keeps its $HOME expandable: double quotes in the text, not single
    assert '"$HOME/.cache/huggingface":/root/.cache/huggingface' in text


def test_no_secret_value_in_any_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_SuperSecretValue123")
    for fmt in FORMATS:
        text = render(fmt, TUNED, OPTIONS, PROV)
        assert "hf_SuperSecretValue123" not in text, fmt


def test_kubernetes_manifest_parses_and_names_the_flags() -> None:
    text = render("kubernetes", WIDE, OPTIONS, PROV)
    assert "&id" not in text  # every value spelled out, no YAML anchors
    docs = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in docs] == ["Deployment", "Service"]
    deployment, service = docs
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "vllm/vllm-openai:v0.11.0"
    meta, back = flags_from(container["args"])
    assert back == WIDE and meta["model"] == OPTIONS.model
    assert "--max-num-seqs" in container["args"] and "--tensor-parallel-size" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    (env,) = container["env"]
    assert env == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", "/root/.cache/huggingface"} <= mounts
    assert {v["name"] for v in pod["volumes"]} == {m["name"] for m in container["volumeMounts"]}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["port"] == 8000
    assert deployment["metadata"]["annotations"]["tuner/trial"] == "17"


def test_kubernetes_name_is_made_a_dns_label() -> None:
    options = DeployOptions(model="m", name="H100 Night_Run #3")
    deployment, _ = yaml.safe_load_all(render("kubernetes", TUNED, options))
    assert deployment["metadata"]["name"] == "h100-night-run-3"


def test_compose_service_parses() -> None:
    doc = yaml.safe_load(render("compose", WIDE, OPTIONS, PROV))
    service = doc["services"]["vllm"]
    assert service["image"] == "vllm/vllm-openai:v0.11.0"
    assert service["ipc"] == "host"
    assert service["environment"] == {"HF_TOKEN": "${HF_TOKEN}"}
    assert service["volumes"] == ["${HOME}/.cache/huggingface:/root/.cache/huggingface"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == 2
    assert flags_from(service["command"])[1] == WIDE


def test_vllm_config_yaml_reads_back_as_vllm_would() -> None:
    text = render("vllm-config", TUNED, OPTIONS, PROV)
    config = yaml.safe_load(text)
    assert config["model"] == OPTIONS.model
    assert config["max-num-seqs"] == 192 and config["gpu-memory-utilization"] == 0.93
    assert config["enable-prefix-caching"] is False
    # vLLM's load_config_file: true -> --key, false -> --no-key, else --key value
    args: list[str] = []
    for key, value in config.items():
        if value is True:
            args.append(f"--{key}")
        elif value is False:
            args.append(f"--no-{key}")
        else:
            args += [f"--{key}", str(value)]
    assert flags_from(args)[1] == TUNED
    assert "vllm serve --config" in text


def test_json_carries_flags_and_provenance() -> None:
    doc = json.loads(render("json", WIDE, OPTIONS, PROV))
    assert VllmFlags.from_dict(doc["flags"]) == WIDE
    assert doc["vllm_serve_args"][0] == OPTIONS.model
    assert doc["container_args"] == container_args(WIDE, OPTIONS)
    assert doc["provenance"]["trial"] == 17 and doc["provenance"]["workload_hash"] == "a1b2c3d4e5f6"
    assert doc["provenance"]["exported_at"].startswith("2026-12-02T07:30")


def test_python_is_valid_and_holds_the_engine_kwargs() -> None:
    text = render("python", WIDE, OPTIONS, PROV)
    tree = ast.parse(text)
    assign = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "engine_kwargs")  # type: ignore[attr-defined]
    kwargs = ast.literal_eval(assign.value)
    assert kwargs.pop("model") == OPTIONS.model
    assert VllmFlags.from_dict(kwargs) == WIDE
    assert "llm = LLM(**engine_kwargs)" in text
    assert text.startswith("# tuner export: study 'h100-night', trial 17")


def test_unknown_format_names_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="allowed: vllm-args, vllm-config, docker"):
        render("helm", TUNED, OPTIONS)


def test_a_format_registered_by_its_decorator_is_rendered_and_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export, "FORMATS", dict(FORMATS))

    @export_format("env-file")
    def env_file(flags: VllmFlags, options: DeployOptions, provenance: Provenance | None) -> str:
        return f"MODEL={options.model}\nARGS={shlex.join(flags.to_args())}\n"

    assert list(export.FORMATS)[-1] == "env-file"
    assert render("env-file", TUNED, OPTIONS).startswith(f"MODEL={OPTIONS.model}\nARGS=--")
    with pytest.raises(ConfigError, match=r"allowed: vllm-args, .*, python, env-file"):
        render("helm", TUNED, OPTIONS)
    with pytest.raises(ValueError, match="registered twice"):
        export_format("env-file")(env_file)


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="port"):
        DeployOptions(model="m", port=0)
    with pytest.raises(ConfigError, match="environment variable"):
        DeployOptions(model="m", secret_env=("HF TOKEN",))
    with pytest.raises(ConfigError, match="model"):
        DeployOptions(model=" ")
    with pytest.raises(ConfigError, match="GPU vendor must be one of nvidia, amd, not 'intel'"):
        DeployOptions(model="m", gpu_vendor="intel")


def test_custom_port_reaches_every_format() -> None:
    options = DeployOptions(model="m", port=9000)
    assert flags_from(shell_words(render("vllm-args", TUNED, options))[3:])[0]["port"] == 9000
    assert "9000:9000" in shell_words(render("docker", TUNED, options))
    deployment, service = yaml.safe_load_all(render("kubernetes", TUNED, options))
    assert deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 9000
    assert service["spec"]["ports"][0]["port"] == 9000


# -- AMD GPUs: every format gives the server its GPUs as ROCm does ---------------------------------------------------

AMD = DeployOptions(model="meta-llama/Llama-3.1-8B-Instruct", image="vllm/vllm-openai-rocm:v0.32.0", gpu_vendor="amd")


def test_amd_docker_line_passes_rocm_devices_not_the_nvidia_runtime() -> None:
    words = shell_words(render("docker", WIDE, AMD, PROV))
    assert words[:2] == ["docker", "run"]
    assert "--gpus" not in words and "--runtime" not in words and "nvidia" not in " ".join(words)
    # vLLM's ROCm docs' docker run: both device files, the video group, ROCm's seccomp and ptrace allowances
    devices = [words[i + 1] for i, w in enumerate(words) if w == "--device"]
    assert devices == ["/dev/kfd", "/dev/dri"]
    assert words[words.index("--group-add") + 1] == "video"
    assert words[words.index("--security-opt") + 1] == "seccomp=unconfined"
    assert words[words.index("--cap-add") + 1] == "SYS_PTRACE"
    assert "--ipc=host" in words and words[words.index("-e") + 1] == "HF_TOKEN"
    meta, back = flags_from(words[words.index("vllm/vllm-openai-rocm:v0.32.0") + 1 :])
    assert back == WIDE and meta["model"] == AMD.model


def test_amd_compose_service_maps_the_device_files() -> None:
    service = yaml.safe_load(render("compose", WIDE, AMD, PROV))["services"]["vllm"]
    assert service["image"] == "vllm/vllm-openai-rocm:v0.32.0"
    assert service["devices"] == ["/dev/kfd:/dev/kfd", "/dev/dri:/dev/dri"]
    assert service["group_add"] == ["video"] and service["security_opt"] == ["seccomp=unconfined"]
    assert "deploy" not in service  # compose's device reservation is NVIDIA's runtime
    assert flags_from(service["command"])[1] == WIDE


def test_amd_kubernetes_asks_the_amd_device_plugin() -> None:
    deployment, _ = yaml.safe_load_all(render("kubernetes", WIDE, AMD, PROV))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"amd.com/gpu": 2}
    assert container["image"] == "vllm/vllm-openai-rocm:v0.32.0"


@pytest.mark.parametrize("vendor", ["nvidia", "amd"])
def test_a_deployment_asks_for_every_gpu_of_its_world_size(vendor: str) -> None:
    # tensor x pipeline parallel: 2 x 2 ranks, each on a GPU of its own
    flags = VllmFlags(tensor_parallel_size=2, extra={"pipeline_parallel_size": 2})
    options = DeployOptions(model="m", gpu_vendor=vendor)
    deployment, _ = yaml.safe_load_all(render("kubernetes", flags, options))
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {f"{vendor}.com/gpu": 4}
    if vendor == "nvidia":
        service = yaml.safe_load(render("compose", flags, options))["services"]["vllm"]
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4
