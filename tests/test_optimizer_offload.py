"""``cluster.offload_optimizer``: the actor's optimizer state waits in host memory between
updates, leaving the device to the rollout (collocated roles on a shared GPU).

On the CPU nothing moves (the state is in host memory already): the run test checks that the
path keeps every number and resumes. The GPU test checks what moves and that the memory is
freed."""

import copy
import json
from pathlib import Path

import pytest
import torch

from embodied.config import load_config
from embodied.learner import TorchEngine
from embodied.runner import train
from embodied.train_config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "env.num_envs=2",
    "env.num_workers=0",
    "algorithm.num_steps=8",
    "algorithm.update_epochs=2",
    "algorithm.num_minibatches=2",
    "policy.hidden_sizes=[32,32]",
    "runner.eval_every=0",
    "runner.final_eval_episodes=2",
    "runner.save_every=1",
    "runner.progress=false",
    "runner.video=false",
    f"runner.total_env_steps={3 * 2 * 8}",
]


def pushcube(tmp_path, name: str, *extra: str) -> TrainConfig:
    overrides = [*TINY, f"runner.output_dir={tmp_path}", f"runner.name={name}", *extra]
    return load_config(TrainConfig, ROOT / "configs/maniskill/pushcube_ppo.yaml", overrides)[0]


def training_rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "optimizer/"))}
        for row in map(json.loads, lines)
        if "policy/loss" in row
    ]


def test_a_run_with_the_optimizer_offloaded_keeps_its_numbers_and_resumes(tmp_path):
    train(pushcube(tmp_path, "plain"))
    offload = "cluster.offload_optimizer=true"
    train(pushcube(tmp_path, "offloaded", offload))
    assert training_rows(tmp_path / "offloaded") == training_rows(tmp_path / "plain")
    rows = [json.loads(line) for line in (tmp_path / "offloaded" / "metrics.jsonl").open()]
    assert [r["optimizer/offloaded_mb"] for r in rows if "policy/loss" in r] == [0.0] * 3
    # resumed from iteration 2 with the state offloaded on load
    checkpoint = tmp_path / "offloaded" / "checkpoints" / "iter_000002"
    train(pushcube(tmp_path, "offloaded", offload, f"runner.resume={checkpoint}"))
    assert training_rows(tmp_path / "offloaded") == training_rows(tmp_path / "plain")


@pytest.mark.gpu
def test_the_optimizer_state_leaves_the_gpu_between_updates_and_comes_back_whole():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)).cuda()
    twin = copy.deepcopy(net)
    engines = [TorchEngine(m, learning_rate=1e-3, max_grad_norm=1.0) for m in (net, twin)]
    x = torch.randn(64, 256, device="cuda")

    def step(engine: TorchEngine, module: torch.nn.Module) -> None:
        engine.backward(module(x).pow(2).mean())
        engine.step()

    for engine, module in zip(engines, (net, twin)):
        step(engine, module)
    state_bytes = 2 * sum(p.numel() * 4 for p in net.parameters())  # Adam's two moments, f32
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert engines[0].offload_optimizer() == state_bytes
    assert torch.cuda.memory_allocated() == before - state_bytes
    moments = [v for s in engines[0].optimizer.state.values() for v in s.values() if v.dim()]
    assert all(v.device.type == "cpu" for v in moments)
    assert engines[0].restore_optimizer() == state_bytes
    for engine, module in zip(engines, (net, twin)):
        step(engine, module)
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)
