"""What a megatron learner leaves in its process: the process group after a refused resume, the
CPU corners after a CPU learner, the current CUDA device, and a helper rank gone before the
close. Runs in one process (a sweep, a notebook, SFT then RL) meet each."""

import multiprocessing
from types import SimpleNamespace

import pytest
import torch
from scripted_envs import ScriptedEnv

from embodied.config import ConfigError
from embodied.roles import LocalRoles
from embodied.train_config import TrainConfig


def test_a_resume_the_learner_refuses_closes_it(monkeypatch):
    """A refused resume (another precision, another weight count) raised out of the roles'
    constructor with the learner open: megatron's process group and groups stayed, and the next
    run in the process failed ("default process group twice") or waited for a dead rank."""
    import embodied.roles
    from embodied.models import ActorCriticConfig, build_policy

    env = ScriptedEnv([0, 0])
    closed = []

    class Refusing:
        policy = build_policy(env.spec, ActorCriticConfig(hidden_sizes=[4], use_images=False))
        engine = SimpleNamespace(torch_policy=policy)

        def load(self, checkpoint):
            raise ConfigError("runner.resume: trained in bf16 but this run trains in fp32")

        def close(self):
            closed.append(True)

    cfg = TrainConfig()
    cfg.runner.device = "cpu"
    monkeypatch.setattr(embodied.roles, "learner_for", lambda *args: Refusing())
    with pytest.raises(ConfigError, match="trained in bf16"):
        LocalRoles(cfg, env, resume={"rng": {}, "counters": {}})
    assert closed == [True]


def test_a_gpu_learner_after_a_cpu_one_leaves_the_cpu_corners(monkeypatch):
    """SFT's learner (on the CPU) installed them; a GPU learner later in the process had its
    weights moved into CPU buffers by ``CudaOnCPU``, and megatron's CUDA RNG functions
    answered nothing."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core.tensor_parallel import random as megatron_random

    from embodied.megatron import cpu, parallel

    cuda_state = cpu._CUDA_RNG_STATE_FUNCTIONS[0]  # (megatron's own, whatever ran before)
    seeded = []
    monkeypatch.setattr(parallel, "model_parallel_cuda_manual_seed", seeded.append)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel.initialize(1, seed=0, device=torch.device("cpu"))
        assert cpu.on_cpu() and megatron_random._get_cuda_rng_state is not cuda_state
        parallel.destroy()
        parallel.initialize(1, seed=3, device=torch.device("cuda"))  # (nothing of it on a GPU)
        assert not cpu.on_cpu() and megatron_random._get_cuda_rng_state is cuda_state
        assert seeded == [3] and not megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    finally:
        parallel.destroy()
        dist.destroy_process_group()


def test_a_learner_on_another_cuda_device_than_the_current_one_is_one_line(monkeypatch):
    """Megatron's buffers go to the current CUDA device: with the policy on cuda:1 they went
    to cuda:0, and the trainable weights with them (the first update failed). Making cuda:1
    current would move a simulator's index-less "cuda" tensors: refused, saying what to do."""
    pytest.importorskip("megatron.core")
    from embodied.megatron.engine import check_current_device
    from embodied.schema import UserError

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # (no GPU here)
    for fine in ("cpu", "cuda", "cuda:0"):
        check_current_device(torch.device(fine))
    with pytest.raises(UserError) as refused:
        check_current_device(torch.device("cuda:1"))
    assert str(refused.value) == (
        "runner.device=cuda:1: the megatron backend trains on the current CUDA device (cuda:0); "
        "use runner.device=cuda, or CUDA_VISIBLE_DEVICES=1 to make that GPU the current one"
    )


def test_a_helper_rank_gone_before_the_close_is_no_broken_pipe():
    """A helper that died after the last call (the OOM killer in the final evaluation): the
    close's "stop" met its broken pipe, and a finished run ended in a BrokenPipeError
    traceback. It is killed with the rest, and rank 0's learner still closes."""
    from embodied.megatron.lockstep import Lockstep

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    helper = context.Process(target=bool, args=(theirs,))  # (exits at once)
    helper.start()
    theirs.close()
    helper.join()
    closed = []
    learner = SimpleNamespace(close=lambda: closed.append(True))
    lockstep = Lockstep(learner, [(helper, ours)])
    lockstep.close()
    assert closed == [True] and lockstep.helpers == []
