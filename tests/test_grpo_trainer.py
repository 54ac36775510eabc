"""The RL trainers with a VLA end to end: on a task where success needs a positive first action,
GRPO (no critic) and PPO (value head) raise the success rate; GRPO groups share reset seeds,
outcomes and masks are per episode; per-task evaluation."""

import json

import torch

from embodied.config import compose
from embodied.evaluate import evaluate, evaluate_by_task, wilson_interval
from embodied.grpo_trainer import _round, train_grpo
from embodied.multitask import MultiTaskEnv
from embodied.schema import (
    ActionSpec,
    CameraSpec,
    EnvSpec,
    Observation,
    ObsSpec,
    PolicyOutput,
    StepOutput,
    check_env,
    ended_rows,
)
from embodied.trainer import TrainConfig


class PushRightEnv:
    """Episodes of 3 steps; success once the first action dimension exceeds 0.5. The image is
    noise drawn from the reset seed, so equal seeds give equal first observations."""

    def __init__(self, num_envs: int, threshold: float = 0.5):
        self.num_envs, self.device, self.threshold = num_envs, torch.device("cpu"), threshold
        self.spec = EnvSpec(
            obs=ObsSpec(cameras=(CameraSpec("cam", 32, 32),), state_names=("t",)),
            action=ActionSpec("joint_delta", ("x", "y"), (-1.0, -1.0), (1.0, 1.0)),
            max_episode_steps=3,
            instructions=("push right",),
        )
        self.t = torch.zeros(num_envs, dtype=torch.long)
        self.images = torch.zeros(num_envs, 32, 32, 3, dtype=torch.uint8)

    def _obs(self):
        return Observation(
            state=self.t.float()[:, None],
            instruction=["push right"] * self.num_envs,
            images={"cam": self.images.clone()},
        )

    def reset(self, *, seed=None, env_ids=None):
        ids = torch.arange(self.num_envs) if env_ids is None else env_ids
        seeds = (
            [None] * len(ids)
            if seed is None
            else ([seed + int(i) for i in ids] if isinstance(seed, int) else list(seed))
        )
        for i, s in zip(ids.tolist(), seeds):
            g = torch.Generator().manual_seed(
                s if s is not None else int(torch.randint(1 << 30, ()))
            )
            self.images[i] = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8)
            self.t[i] = 0
        return self._obs()

    def step(self, actions):
        self.t += 1
        success = actions[:, 0] > self.threshold
        truncated = self.t >= 3
        final = self._obs() if truncated.any() else None
        if truncated.any():
            self.reset(env_ids=truncated.nonzero().squeeze(1))
        return StepOutput(
            obs=self._obs(),
            reward=success.float(),
            terminated=torch.zeros_like(success),
            truncated=truncated,
            success=success,
            final_obs=final,
            ended=ended_rows(truncated),
        )

    def render(self):
        return self.images.clone()

    def close(self):
        pass


POLICY = dict(
    name="vla",
    head="gaussian",
    chunk_size=1,
    d_model=32,
    layers=1,
    heads=2,
    vision_pretrained=False,
    vision_width=0.25,
    vision_depth=0.25,
    text_pretrained=False,
    text_hidden=32,
    text_layers=1,
    freeze_vision=True,
    value_head=False,
    init_log_std=-0.5,
)


def _cfg(tmp_path, policy=POLICY, **alg):
    return compose(
        TrainConfig,
        [
            (
                "test",
                {
                    "seed": 0,
                    "policy": policy,
                    "algorithm": {
                        "name": "grpo",
                        "group_size": 4,
                        "groups_per_batch": 2,
                        "max_rounds": 3,
                        "learning_rate": 3e-3,
                        "update_epochs": 2,
                        "num_minibatches": 2,
                        **alg,
                    },
                    "runner": {
                        "name": "grpo",
                        "output_dir": str(tmp_path),
                        "total_env_steps": 8 * 3 * 12,
                        "eval_every": 0,
                        "eval_episodes": 16,
                        "final_eval_episodes": 16,
                        "save_every": 0,
                        "progress": False,
                    },
                },
            )
        ],
    )


def test_the_test_env_passes_the_contract():
    check_env(PushRightEnv(4), seed=1)


def test_group_members_share_their_reset_and_outcomes_are_per_episode():
    from embodied.models import VLA, VLAConfig

    torch.manual_seed(0)
    env = PushRightEnv(8)
    policy = VLA(
        env.spec, VLAConfig(**{k: v for k, v in POLICY.items() if k != "name"}, name="vla")
    )
    rollout, success, valid = _round(env, policy, [5] * 4 + [6] * 4, T=3)
    first = rollout.obs.images["cam"][0]  # [B, H, W, 3] at t = 0
    assert all(torch.equal(first[0], first[i]) for i in range(4)) and not torch.equal(
        first[0], first[4]
    )
    assert valid.all()  # 3-step episodes fill the 3 chunks exactly
    assert success.tolist() == (rollout.actions[:, :, 0, 0] > 0.5).any(0).tolist()


def test_grpo_raises_success(tmp_path):
    torch.manual_seed(0)
    cfg = _cfg(tmp_path)
    (tmp_path / "grpo").mkdir()
    summary = train_grpo(cfg, PushRightEnv(8), tmp_path / "grpo", None)
    before, after = (
        summary["before"]["all"]["eval/success_rate"],
        summary["final"]["all"]["eval/success_rate"],
    )
    rows = [
        json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    train_success = [r["episode/success_once"] for r in rows if "episode/success_once" in r]
    assert sum(train_success[:3]) / 3 < 0.85 and sum(train_success[-3:]) / 3 > 0.95, train_success
    assert before < 0.5 and after == 1.0  # deterministic (mean) actions, 16 evaluation episodes
    assert any("grpo/kept_groups" in r and r["grpo/kept_groups"] >= 1 for r in rows)
    assert (tmp_path / "grpo" / "last" / "model.safetensors").exists()


def test_grpo_through_smolvlas_stochastic_flow_raises_success(tmp_path):
    from tiny_vlms import smolvlm

    torch.manual_seed(0)
    policy = {
        "name": "smolvla",
        "vlm_path": str(smolvlm(tmp_path / "smolvlm")),
        "chunk_size": 1,
        "flow_steps": 3,
        "flow_noise_std": 0.3,
    }
    cfg = _cfg(tmp_path, policy)
    (tmp_path / "grpo").mkdir()
    summary = train_grpo(cfg, PushRightEnv(8), tmp_path / "grpo", None)
    before, after = (
        summary["before"]["all"]["eval/success_rate"],
        summary["final"]["all"]["eval/success_rate"],
    )
    rows = [
        json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    train_success = [r["episode/success_once"] for r in rows if "episode/success_once" in r]
    assert before < 0.5 and after == 1.0, (
        before,
        after,
        train_success,
    )  # deterministic flow, 16 episodes


class PixelPolicy:
    """Deterministic: pushes right by the first pixel's red value, so success depends on the seed."""

    def act(self, obs, *, deterministic=True):
        x = obs.images["cam"][:, 0, 0, 0].float() / 127.5 - 1.0  # f32 [B]
        actions = torch.stack([x, torch.zeros_like(x)], -1)[:, None]  # f32 [B, 1, 2]
        return PolicyOutput(actions=actions, logprob=torch.zeros(len(x)))


def test_evaluation_by_task_equals_each_task_alone():
    env = MultiTaskEnv([PushRightEnv(4), PushRightEnv(3, threshold=0.0)], ["a", "b"])
    together = evaluate_by_task(
        env, PixelPolicy(), episodes=10, seed=3
    )  # 3 rounds, the last one partial
    for name, sub in zip(env.names, env.envs):
        alone = evaluate(sub, PixelPolicy(), episodes=10, seed=3)
        timing = ("eval/env_steps_per_s", "eval/policy_ms")  # measured, not reproducible
        assert {k: v for k, v in together[name].items() if k not in timing} == {
            k: v for k, v in alone.items() if k not in timing
        }
        assert alone["eval/episodes"] == 10 and all(together[name][k] > 0 for k in timing)
    assert 0 < together["a"]["eval/success_rate"] < together["b"]["eval/success_rate"] < 1


def test_wilson_interval_golden():
    lo, hi = wilson_interval(92, 100)
    assert abs(lo - 0.8501) < 1e-3 and abs(hi - 0.9589) < 1e-3


def test_ppo_with_a_value_head_raises_success(tmp_path):
    from embodied.trainer import _train

    torch.manual_seed(0)
    cfg = compose(
        TrainConfig,
        [
            (
                "test",
                {
                    "seed": 0,
                    "policy": {**POLICY, "value_head": True},
                    "algorithm": {
                        "name": "ppo",
                        "num_steps": 6,
                        "gamma": 0.8,
                        "learning_rate": 3e-3,
                        "update_epochs": 4,
                        "num_minibatches": 2,
                        "target_kl": None,
                    },
                    "runner": {
                        "name": "ppo",
                        "output_dir": str(tmp_path),
                        "total_env_steps": 8 * 6 * 15,
                        "eval_every": 0,
                        "eval_episodes": 16,
                        "final_eval_episodes": 16,
                        "save_every": 0,
                        "progress": False,
                    },
                },
            )
        ],
    )
    (tmp_path / "ppo").mkdir()
    summary = _train(cfg, PushRightEnv(8), tmp_path / "ppo", None)
    rows = [
        json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()
    ]
    train_success = [r["episode/success_once"] for r in rows if "episode/success_once" in r]
    assert sum(train_success[:2]) / 2 < 0.85 and summary["final"]["eval/success_rate"] == 1.0, (
        train_success
    )
    explained = [r["value/explained_variance"] for r in rows if "value/explained_variance" in r]
    assert explained[0] < 0.1 and max(explained) > 0.5, explained  # the critic learns the returns
