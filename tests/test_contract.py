"""The contract checks catch what they check: each broken env or policy below breaks one rule,
and ``check_env`` / ``check_policy`` refuse it with the message naming that rule."""

from dataclasses import replace

import pytest
import torch
from scripted_envs import ScriptedEnv, ScriptedPolicy

from embodied.contract import ContractError, check_env, check_policy, same_device
from embodied.schema import CameraSpec, StepOutput


class SameStart(ScriptedEnv):
    """ScriptedEnv without the env index in its state: equal seeds give equal rows, so the
    seeded-reset checks apply."""

    def _obs(self, rows=slice(None)):
        obs = super()._obs(rows)
        obs.state[:, 1] = 0.0
        return obs


def env(cls=SameStart, **kw) -> ScriptedEnv:
    return cls([2, 0, 3], max_episode_steps=5, **kw)


class Unseeded(SameStart):
    def reset(self, *, seed=None, env_ids=None):
        super().reset(seed=seed, env_ids=env_ids)
        self.t += torch.rand(()).item()  # a reset that draws from the global generator
        return self._obs()


class ResetsEverything(SameStart):
    def reset(self, *, seed=None, env_ids=None):
        return super().reset(seed=seed)  # env_ids ignored


class ResetsNothing(SameStart):
    def reset(self, *, seed=None, env_ids=None):
        if env_ids is not None:
            return self._obs()  # a partial reset that resets nothing (and reseeds nothing)
        return super().reset(seed=seed)


class RedrawsEveryRow(SameStart):
    """Images are views of one frame buffer (as a GPU renderer's may be), and a partial reset
    draws every row of it again, otherwise: the other rows' images change under the reset."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        cameras = (CameraSpec("cam", 4, 4),)
        self.spec = replace(self.spec, obs=replace(self.spec.obs, cameras=cameras))
        self.frames = torch.zeros(self.num_envs, 4, 4, 3, dtype=torch.uint8)  # uint8 [B, 4, 4, 3]
        self.partial_resets = 0

    def _obs(self, rows=slice(None)):
        obs = super()._obs(rows)
        self.frames.fill_(self.partial_resets)
        return replace(obs, images={"cam": self.frames[rows]})  # (a view: no copy)

    def reset(self, *, seed=None, env_ids=None):
        self.partial_resets += env_ids is not None
        return super().reset(seed=seed, env_ids=env_ids)


class TruncatesEarly(SameStart):
    """Cuts every episode after 2 steps while its spec says 5."""

    def _advance(self, rows):
        spec = self.spec
        self.spec = replace(spec, max_episode_steps=2)
        try:
            return super()._advance(rows)
        finally:
            self.spec = spec


class StepEdit(SameStart):
    """Each step's output passed through ``edit`` (the test's breakage)."""

    def __init__(self, edit, **kw):
        super().__init__([2, 0, 3], max_episode_steps=5, **kw)
        self.edit = edit

    def step(self, actions):
        out = super().step(actions)
        return self.edit(out) or out


def no_final_obs(out: StepOutput) -> None:
    out.final_obs = None


def ended_rows_wrong(out: StepOutput) -> None:
    if out.ended is not None:
        out.ended = out.ended + 1


def final_obs_of_running_rows_differ(out: StepOutput) -> None:
    if out.final_obs is not None:
        out.final_obs.state += 1.0


def final_obs_is_the_reset_obs(out: StepOutput) -> None:
    if out.final_obs is not None:
        out.final_obs = out.obs  # the new episode's first observation, not the last one


def final_obs_when_nothing_ended(out: StepOutput) -> None:
    if out.final_obs is None:
        out.final_obs = out.obs


def reward_in_float64(out: StepOutput) -> None:
    out.reward = out.reward.double()


def never_ends(out: StepOutput) -> None:
    out.terminated = torch.zeros_like(out.terminated)
    out.truncated = torch.zeros_like(out.truncated)
    out.final_obs = None
    out.ended = None


class BadFrames(SameStart):
    def render(self, env_ids=None):
        return torch.zeros(self.num_envs, 8, 8, 4, dtype=torch.uint8)  # RGBA, not RGB


class SortsRenderedRows(SameStart):
    """Renders a frame per environment (its index in every pixel), but ``render(ids)`` gives the
    rows in ascending order rather than in ids' order."""

    def render(self, env_ids=None):
        frames = (
            torch.arange(self.num_envs, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 4, 4, 3)
        )
        return frames if env_ids is None else frames[env_ids.sort().values]


@pytest.mark.parametrize(
    "broken, message",
    [
        (env(Unseeded), r"reset\(seed=s\) twice gave different states"),
        (env(ScriptedEnv), r"reset\(seed=\[s\]\*B\): state differs across envs"),
        (env(ResetsEverything), "partial reset changed environments it was not asked to reset"),
        (env(RedrawsEveryRow), "partial reset changed environments it was not asked to reset"),
        (
            env(ResetsNothing),
            r"reset\(seed=100, env_ids=\[0\]\) gave env 0 another start than reset\(seed=100\)",
        ),
        (
            env(TruncatesEarly),
            r"step\(1\): truncated after \[2, 2\] steps, not at max_episode_steps=5",
        ),
        (StepEdit(no_final_obs), r"step\(1\): episodes ended but final_obs is None"),
        (StepEdit(ended_rows_wrong), r"step\(1\)\.ended: expected long \[0\] on the CPU"),
        (StepEdit(final_obs_of_running_rows_differ), "final_obs rows of running envs"),
        (StepEdit(final_obs_when_nothing_ended), r"step\(0\): final_obs given although no"),
        (
            StepEdit(final_obs_is_the_reset_obs),
            r"step\(1\): final_obs of ended envs \[0\] is their new episode's first observation",
        ),
        (StepEdit(reward_in_float64), r"step\(0\)\.reward: dtype torch\.float64"),
        (StepEdit(never_ends), "an episode ran past max_episode_steps=5 without truncation"),
        (env(BadFrames), r"render\(\): expected uint8 \[B, H, W, 3\], got torch.uint8 \(3, 8"),
        (env(SortsRenderedRows), r"render\(env_ids=\[2, 0\]\) is not render\(\)'s rows \[2, 0\]"),
    ],
    ids=lambda case: type(case).__name__ if isinstance(case, ScriptedEnv) else None,
)
def test_check_env_refuses_an_env_that_breaks_one_rule(broken, message):
    with pytest.raises(ContractError, match=message):
        check_env(broken)


def test_check_env_passes_the_env_the_broken_ones_are_made_from():
    report = check_env(env())
    assert report == {"num_envs": 3, "device": "cpu", "steps": 6}


def test_a_tensor_on_another_gpu_is_on_the_wrong_device():
    """The device's index counts (a GPU machine checks an env on it: tests/test_gpu.py)."""
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert same_device(cuda1, cuda1) and same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(cuda0, cuda1) and not same_device(cuda1, cuda0)
    assert not same_device(torch.device("cpu"), cuda0)


def test_an_env_whose_episodes_never_end_within_max_steps_is_refused():
    with pytest.raises(ContractError, match=r"no episode ended within 1 steps"):
        check_env(env(), max_steps=1)  # the first end is at step 2


class PolicyEdit(ScriptedPolicy):
    """ScriptedPolicy with one of its answers broken."""

    def __init__(self, act=None, evaluate=None):
        super().__init__(chunk_size=2)
        self.edit_act = act
        self.edit_evaluate = evaluate

    def act(self, obs, *, deterministic=False):
        out = super().act(obs, deterministic=deterministic)
        if self.edit_act is not None:
            self.edit_act(out, deterministic)
        return out

    def evaluate(self, obs, output, *, level="chunk"):
        at_level, entropy, value = super().evaluate(obs, output, level=level)
        if self.edit_evaluate is not None:
            return self.edit_evaluate(at_level), entropy, value.detach()
        return at_level, entropy, value


def out_of_bounds(out, deterministic):
    out.actions += 1000.0  # the scripted env's bounds are +-100


def random_when_deterministic(out, deterministic):
    if deterministic:
        out.actions += 0.01 * torch.rand_like(out.actions)


def tokens_off_the_total(out, deterministic):
    out.logprob = out.logprob + 0.1


@pytest.mark.parametrize(
    "broken, message",
    [
        (PolicyEdit(act=out_of_bounds), "act\\(\\).actions outside ActionSpec bounds"),
        (PolicyEdit(act=random_when_deterministic), "is not deterministic"),
        (PolicyEdit(act=tokens_off_the_total), "logp_token does not sum to logprob \\(off by 1"),
        (PolicyEdit(evaluate=lambda lp: lp + 0.5), "differs from act\\(\\)'s by 5.00e-01"),
        (PolicyEdit(evaluate=lambda lp: lp.detach()), "no gradient reaches the policy's weights"),
    ],
)
def test_check_policy_refuses_a_policy_that_breaks_one_rule(broken, message):
    with pytest.raises(ContractError, match=message):
        check_policy(broken, env().spec)


def test_check_policy_passes_the_policy_the_broken_ones_are_made_from():
    report = check_policy(PolicyEdit(), env().spec)
    assert report == {"chunk": 2, "logprob_error": 0.0}
