"""What the cluster tests share: tiny runs on a local Ray (the fixtures ``local_ray`` and
``one_thread`` are in conftest.py), their metric rows compared with the embedded run's, and
what the learner is sent, recorded."""

import json
import numbers
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from scripted_envs import GRPO, PushRightEnv, ScriptedEnv, push_right_envs, run_on

from embodied.cluster.learner import RemoteLearner
from embodied.cluster.roles import RayRoles
from embodied.config import load_config
from embodied.roles import Roles
from embodied.schema import UserError
from embodied.train_config import TrainConfig

ray = pytest.importorskip("ray")


ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "env.num_envs=2",
    "env.num_workers=0",  # the simulator in the env worker's process: no subprocess to start
    "algorithm.num_steps=8",
    "algorithm.update_epochs=2",
    "algorithm.num_minibatches=2",
    "algorithm.anneal_lr=false",
    "policy.hidden_sizes=[32,32]",
    "runner.eval_every=0",
    "runner.eval_episodes=2",
    "runner.final_eval_episodes=2",
    "runner.save_every=1",
    "runner.progress=false",
    "runner.video=false",
    f"runner.total_env_steps={3 * 2 * 8}",
]
# one worker per role on 2 CPUs: the env worker's simulator runs in its own subprocess
ON_RAY = ["cluster.enabled=true", "cluster.rollout.num_cpus=0.5", "cluster.actor.num_cpus=0.5"]
CLUSTER = dict(enabled=True, rollout=dict(num_cpus=0.5), actor=dict(num_cpus=0.5))
TWO_ENV_WORKERS = {**CLUSTER, "env": dict(workers=2, num_cpus=0.5)}
# GRPO with one round per iteration, every group kept: a fixed count of chunks per update
ONE_ROUND = {**GRPO, "max_rounds": 1, "dynamic_sampling": False}
TIMING = ("time/", "cluster/", "eval/policy_ms", "eval/env_steps_per_s")


def pushcube(tmp_path, name, extra=()):
    overrides = [*TINY, f"runner.output_dir={tmp_path}", f"runner.name={name}", *extra]
    return load_config(TrainConfig, ROOT / "configs/maniskill/pushcube_ppo.yaml", overrides)[0]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def untimed(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not k.startswith(TIMING) and k != "minutes"}


def assert_same_numbers(a: list[dict], b: list[dict], rel=1e-6, abs=1e-9, skip=()) -> None:
    """Row by row, every metric but timings (and ``skip``) equal to ``rel`` (relative)."""
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b):
        keys = {k for k in row_a if not k.startswith(TIMING)}
        assert keys == {k for k in row_b if not k.startswith(TIMING)}
        for key in keys - set(skip):
            assert row_a[key] == pytest.approx(row_b[key], rel=rel, abs=abs), key


def block_ray(monkeypatch) -> None:
    """From here on, ``import ray`` (or any of its modules) fails in this process."""
    for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")] + ["ray"]:
        monkeypatch.setitem(sys.modules, name, None)


def run_rounds(
    run_dir: Path, iterations: int, env_factory=push_right_envs, cluster=TWO_ENV_WORKERS
) -> dict:
    """One-round GRPO iterations of the test task on two env workers and a rollout worker."""
    return run_on(
        None,
        run_dir,
        total_env_steps=8 * 3 * iterations,
        cluster=cluster,
        env_factory=env_factory,
        algorithm=ONE_ROUND,
    )


def record_calls(monkeypatch, order: list, cls, name: str, label: str) -> None:
    """Each call of ``cls.name`` (a driver-side method) first appends ``label`` to ``order``."""
    whole = getattr(cls, name)

    def recorded(*args, **kwargs):
        order.append(label)
        return whole(*args, **kwargs)

    monkeypatch.setattr(cls, name, recorded)


class Recorder:
    """Keeps what the learner is sent: each update's round (``samples``: the batch the driver
    handed over; the tests here collect one round per update)."""

    def __init__(self):
        self.samples = []
        self.rounds = []
        self.add_original = RemoteLearner.add_round
        self.original = RemoteLearner.start_update
        recorder = self

        def add_round(learner_self, shards):
            try:  # (now: its env worker may be lost later)
                recorder.rounds.append(shards.fetch())
            except ray.exceptions.ObjectLostError:
                pass  # (lost with its env worker: the learner's add_round says so)
            return recorder.add_original(learner_self, shards)

        def start_update(learner_self):
            (batch,) = recorder.rounds  # (one round per update)
            recorder.samples.append(batch)
            recorder.rounds = []
            return recorder.original(learner_self)

        self.add_round = add_round
        self.start_update = start_update

    def patch(self, monkeypatch) -> None:
        monkeypatch.setattr(RemoteLearner, "add_round", self.add_round)
        monkeypatch.setattr(RemoteLearner, "start_update", self.start_update)

    def assert_whole_rounds(self) -> None:
        """No transition of a lost partial round in any update's batch: every episode starts at
        its reset (the test task's state is the step index) and runs its 3 steps in order."""
        for samples in self.samples:
            state = samples.obs.state.view(3, 8)  # [T, B]: each round's chunks, time-major
            assert torch.equal(state, torch.arange(3.0)[:, None].expand(3, 8))


def roles_on(tmp_path, cluster: dict, policy: dict, env_factory, env=None) -> RayRoles:
    """The roles of a one-round GRPO run on 8 environments of ``env_factory``, started
    (``env``: more of the env config)."""
    from embodied.cluster import ray_roles
    from embodied.config import compose

    source = {
        "seed": 0,
        "policy": policy,
        "algorithm": ONE_ROUND,
        "env": {"num_envs": 8, **(env or {})},
        "cluster": cluster,
        "runner": {"output_dir": str(tmp_path), "progress": False},
    }
    cfg = compose(TrainConfig, [("test", source)])
    roles = ray_roles(cfg, None, tmp_path, env_factory=env_factory)
    assert isinstance(roles, Roles)  # every member of the protocol the runner drives
    return roles


def discarded_rounds(table: list[dict]) -> list[tuple[int, int]]:
    """(iteration, rounds discarded so far) of each metrics row that logs a discarded round."""
    key = "cluster/discarded_rounds"
    return [(r["iteration"], r[key]) for r in table if key in r]


class WholeSeedEnv(ScriptedEnv):
    """A ScriptedEnv whose observation tells a reset seeded by one int (ManiSkill's GPU backend
    resets such a batch in one call) from one seeded by a list: its seed column is negated."""

    def reset(self, *, seed=None, env_ids=None):
        super().reset(seed=seed, env_ids=env_ids)
        if isinstance(seed, numbers.Integral):
            self.seed.neg_()
        return self._obs()


def whole_seed_envs(env_cfg) -> WholeSeedEnv:
    """A cluster env worker's environments: ``env_cfg.num_envs`` WholeSeedEnv rows."""
    return WholeSeedEnv([0] * env_cfg.num_envs)


class Saboteur:
    """A cluster env worker's ``PushRightEnv`` that kills a process mid-round when the test arms
    it (a cluster's ``env_factory``). The test writes ``DIR/armed-<n>`` holding the pid to kill
    (``self``: the env worker that finds it; ``raise``: no kill, the step raises, as a simulator
    with a bug). The first environment that reaches the second step
    of a round claims it (``DIR/claimed-<n>``, its process id inside), sends SIGKILL and steps
    on; a process restarted afterwards finds it claimed."""

    def __init__(self, gate_dir):
        self.gate_dir = str(gate_dir)

    def __call__(self, env_cfg) -> PushRightEnv:
        return SabotagedPushRightEnv(env_cfg.num_envs, self.gate_dir)

    def arm(self, n: int, pid: int | str) -> None:
        path = Path(self.gate_dir) / f"armed-{n}"
        path.with_suffix(".tmp").write_text(str(pid))
        path.with_suffix(".tmp").replace(path)

    def killed(self, n: int) -> int | None:
        """The pid of the process that claimed gate ``n`` (it killed itself, or the armed pid)."""
        path = Path(self.gate_dir) / f"claimed-{n}"
        text = path.read_text() if path.exists() else ""
        return int(text) if text else None


# a simulator's own error (a bug: its traceback), and a user's (a non-finite action: one line)
BROKE = {
    "raise": RuntimeError("the simulator broke"),
    "user": UserError("the actions of environments [1] are not finite"),
}


class SabotagedPushRightEnv(PushRightEnv):
    def __init__(self, num_envs: int, gate_dir: str):
        super().__init__(num_envs)
        self.gate_dir = Path(gate_dir)
        self.round_steps = 0

    def reset(self, *, seed=None, env_ids=None):
        if env_ids is None:  # (a round's reset)
            self.round_steps = 0
        return super().reset(seed=seed, env_ids=env_ids)

    def step(self, actions):
        self.round_steps += 1
        if self.round_steps == 2:
            for armed in sorted(self.gate_dir.glob("armed-*")):
                claimed = self.gate_dir / armed.name.replace("armed", "claimed")
                try:
                    handle = os.open(claimed, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    continue
                target = armed.read_text()
                if target in BROKE:
                    os.close(handle)
                    raise BROKE[target]
                pid = os.getpid() if target == "self" else int(target)
                os.write(handle, str(pid).encode())
                os.close(handle)
                os.kill(pid, signal.SIGKILL)
        return super().step(actions)


def unready_evaluators(env_cfg) -> PushRightEnv:
    """Env workers' environments (4 of the run's 8 each); an evaluation worker's (all 8) cannot
    start, as on a node without the simulator's assets."""
    if env_cfg.num_envs == 8:
        raise UserError("env.task: its assets are not on this node")
    return PushRightEnv(env_cfg.num_envs)


class OverflowAtClose(PushRightEnv):
    """Closing raises a user's error, as MuJoCo Warp's last contact-buffer check can."""

    def close(self):
        raise UserError("MuJoCo push: the contact buffer overflowed")


def overflowing_at_close(env_cfg) -> OverflowAtClose:
    return OverflowAtClose(env_cfg.num_envs)
