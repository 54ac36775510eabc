"""The SO-101's kinematics in torch and the scripted experts: forward kinematics equal MuJoCo's,
inverse kinematics reach what is reachable, and each task's expert solves it on 100 seeds on
both backends alike (the issue's parity measure: at most 2 episodes apart)."""

import mujoco
import numpy as np
import pytest
import torch

from embodied.simulators.mujoco import MuJoCoConfig, make_env
from embodied.simulators.mujoco.arm import JOINTS, RANGES, scene
from embodied.simulators.mujoco.experts import EXPERTS
from embodied.simulators.mujoco.ik import Chain


def test_forward_kinematics_equal_mujocos():
    model = mujoco.MjModel.from_xml_string(scene(""))
    data = mujoco.MjData(model)
    adr = [model.jnt_qposadr[model.joint(j).id] for j in JOINTS]
    rng = np.random.default_rng(0)
    q = np.array([[rng.uniform(*RANGES[j]) for j in JOINTS] for _ in range(20)])  # f64 [20, 6]
    tcp, frame = Chain().forward(torch.from_numpy(q).float())
    for i in range(len(q)):
        data.qpos[adr] = q[i]
        mujoco.mj_kinematics(model, data)
        np.testing.assert_allclose(tcp[i], data.site("tcp").xpos, atol=2e-6)
        np.testing.assert_allclose(frame[i], data.body("gripper").xmat.reshape(3, 3), atol=2e-6)


def test_inverse_kinematics_reach_reachable_points_pointing_down():
    chain = Chain()
    g = torch.Generator().manual_seed(0)
    # poses that point the fingers down (lift + elbow + wrist = pi/2) give reachable targets
    lift = torch.rand(64, generator=g) * 0.8 - 0.4
    elbow = torch.rand(64, generator=g) * 0.6
    pan = torch.rand(64, generator=g) * 1.2 - 0.6
    wrist = torch.pi / 2 - lift - elbow
    posed = torch.stack([pan, lift, elbow, wrist, pan], 1)  # the roll undoes the pan
    inside = (wrist < RANGES["wrist_flex"][1]).nonzero()[:, 0]
    target, _ = chain.forward(posed[inside])
    home = torch.zeros(len(inside), 6)
    home[:, 1:4] = torch.tensor([-0.4, 0.37, 1.59])
    solved = chain.solve(target, home, down=True, iterations=30)
    reached, frame = chain.forward(solved)
    assert (reached - target).norm(dim=1).max() < 1e-4  # metres
    assert frame[:, 2, 2].min() > 0.999  # the fingers point down (the frame's z up)
    jaw = frame[:, :2, 0]
    assert (jaw[:, 0] * jaw[:, 1]).abs().max() < 1e-2  # the jaws close along x or y


# the contact tasks take 35-60 s each on 2 cores: in the slow run (.ci/run runs it after the rest)
TASKS = [t if t == "reach" else pytest.param(t, marks=pytest.mark.slow) for t in sorted(EXPERTS)]


@pytest.mark.parametrize("task", TASKS)
def test_each_expert_solves_its_task_on_both_backends_alike(task):
    seeds = list(range(1000, 1100))
    successes = {}
    for backend in ("rollout", "warp"):
        with make_env(MuJoCoConfig(task=task, num_envs=100, backend=backend)) as env:
            expert = EXPERTS[task](env.device)
            obs = env.reset(seed=seeds)
            ever = torch.zeros(100, dtype=torch.bool)
            for _ in range(env.spec.max_episode_steps):
                out = env.step(expert.act(obs).actions[:, 0])
                ever |= out.success
                obs = out.obs
            assert out.ended is not None and len(out.ended) == 100  # one episode each, whole
            successes[backend] = int(ever.sum())
    assert successes["rollout"] >= 97, successes  # measured: 100 of 100 on every task
    assert abs(successes["rollout"] - successes["warp"]) <= 2, successes
