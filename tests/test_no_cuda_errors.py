"""A GPU asked for on a machine without CUDA: one line naming the key and what to use instead,
exit code 2, no run directory. (The warp backend's env.device=cuda: tests/test_mujoco_warp.py.)"""

import pytest
import torch
from tiny_runs import TINY_REACH

from embodied.cli import main

M = "configs/mujoco/reach_ppo.yaml"
TINY = [*TINY_REACH, "runner.video=false", "policy.hidden_sizes=[32]"]
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@needs_no_cuda
def test_maniskill_on_the_gpu_backend_without_cuda_is_a_one_line_error(capsys, tmp_path):
    # (its own output folder: the README's `make train` leaves a run in runs/pushcube_ppo)
    argv = ["train", "configs/maniskill/pushcube_ppo.yaml", "env.backend=gpu"]
    assert main([*argv, f"runner.output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip() == (
        "embodied: error: env.backend=gpu needs a CUDA GPU and this machine has none; use "
        "env.backend=cpu"
    )


@needs_no_cuda
def test_a_learner_on_cuda_without_cuda_is_a_one_line_error_and_no_run(capsys, tmp_path):
    argv = ["train", M, "runner.device=cuda", f"runner.output_dir={tmp_path}", *TINY]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        "embodied: error: runner.device=cuda needs a CUDA GPU and this machine has none; use "
        "runner.device=auto (the environment's device) or cpu"
    )
    assert list(tmp_path.iterdir()) == []


@needs_no_cuda
def test_serving_on_cuda_without_cuda_is_a_one_line_error(capsys, tmp_path):
    # (the device is checked before the checkpoint is read: none here)
    assert main(["serve", str(tmp_path / "ckpt"), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == (
        "embodied: error: --device=cuda needs a CUDA GPU and this machine has none; use "
        "--device cpu (or auto)"
    )
