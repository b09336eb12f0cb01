"""`tuner calibrate` against real vLLM (the CPU build serving the tiny model, the shared server): the probe runs
through tuner's own load client, the profile records the server's version and KV cache, and it is usable: the
emulator starts on it as a CPU server and the twin predicts with it."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from tests.real_vllm import RealVllm
from tuner.cli import main
from tuner.config import parse_job
from tuner.emulator import Emulator
from tuner.flags import VllmFlags
from tuner.step_profile import load_profile
from tuner.twin.simulate import simulate
from tuner.vllm_pin import PINNED_VLLM

pytestmark = pytest.mark.real_vllm


def test_calibrate_writes_a_usable_profile_of_the_real_server(
    real_vllm: RealVllm, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "cpu-profile.json"
    monkeypatch.setattr(
        sys,
        "argv",
        ["tuner", "calibrate", "--url", real_vllm.base_url, "-o", str(out), "--concurrency", "1,4",
         "--input-len", "64,256", "--output-len", "8", "--rounds", "2"],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main()
    text = "".join(capsys.readouterr())
    assert exc.value.code == 0, text
    profile = load_profile(out)
    assert profile.vllm_version == PINNED_VLLM and profile.model == real_vllm.model
    assert profile.device == "cpu" and profile.block_size == 128
    # 1 GiB of the tiny model's 2 KiB tokens (4 layers x 2 KV heads x 64 x 2 x 2 bytes) in blocks of 128
    assert profile.num_gpu_blocks == 4096
    assert len(profile.fitted_from.points) == 4
    assert all(p.measured_output_tok_s > 0 and p.predicted_output_tok_s > 0 for p in profile.fitted_from.points)
    # A busy server may hand a point's few tokens over in one read (a TPOT of 0 is then what the client saw); under
    # stress-ng it did so at every point, and calibrate must say that a decode step went untimed.
    seen = [p for p in profile.fitted_from.points if p.measured_tpot_mean_s > 0]
    assert ("warning: every reply came in one piece" in text) == (not seen), text
    # Decode steps cost time in the fitted model wherever the client measured them. How the fit splits that cost
    # among its terms is the data's: under a busy machine's noise it can all go to the per-context-token term.
    assert all(p.predicted_tpot_mean_s > 0 for p in seen)

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    argv = ["--device", "cpu", "--model", str(real_vllm.model_dir), "--max-model-len", "1024", "--profile", str(out)]
    emu = Emulator.from_args(argv, log_stream=io.StringIO())
    assert emu.plan.num_gpu_blocks == profile.num_gpu_blocks  # the emulator's arithmetic agrees with the server's
    job = parse_job(
        {
            "study": {"name": "calibrated"},
            "target": {"launcher": "emulator", "model": str(real_vllm.model_dir), "gpu": "cpu", "profile": str(out)},
            "space": {"max_num_seqs": {"choices": [4, 8]}, "max_model_len": 1024},
            "workload": {"input_len": 128, "output_len": 16},
            "arrival": {"concurrency": 4, "requests": 16},
        }
    )
    point = simulate(job, VllmFlags(max_num_seqs=4, max_model_len=1024))
    assert point.started and len([r for r in point.records if r.ok]) == 16
