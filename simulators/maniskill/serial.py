"""``SerialEnvs``: several single-environment physx_cpu ManiSkill envs behind the batched-env
interface that physx_cuda envs have, so that ``ManiSkillCore`` runs one code path on both.

physx_cpu simulates one environment per ManiSkill instance. Stepping n of them one after the
other and doing the observation mapping, time limits and resets once on the stacked batch costs
one set of tensor ops per worker step instead of one per environment (the per-op overhead of
torch on a few floats is larger than the arithmetic).

Besides step/reset it has the batched env's state interface, one instance per row:
``get_state_dict``/``set_state_dict(state, env_idx)``, ``get_obs``, ``agent``'s controller state
and the per-environment RNGs, so that the core's reset-by-copy (``ManiSkillCore.reset``) runs
here as on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch


def _merge(trees: list) -> dict | torch.Tensor:
    """Concatenate matching tensor leaves of several observation dicts along the batch dim."""
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(trees) if len(trees) > 1 else first
    return {k: _merge([t[k] for t in trees]) for k in first}


def _row(tree: dict | torch.Tensor, i: int) -> dict | torch.Tensor:
    """Row ``i`` of every tensor leaf, as a batch of one (a copy: no view into ``tree``)."""
    if isinstance(tree, torch.Tensor):
        return tree[i : i + 1].clone()
    return {k: _row(v, i) for k, v in tree.items()}


def _ids(env_idx, n: int) -> list[int]:
    if env_idx is None:
        return list(range(n))
    return [int(i) for i in torch.as_tensor(env_idx).tolist()]


class _SerialAgent:
    """The first env's agent (robot, controller configs: the same in every env), except for the
    controller state, which is every env's, batched like a GPU env's ``agent``'s."""

    def __init__(self, envs: list):
        self._envs = envs

    def __getattr__(self, name):
        return getattr(self.__dict__["_envs"][0].agent, name)

    def get_controller_state(self) -> dict:
        """Per-env controller state (e.g. ``target_qpos``), leaves [n, D]; {} if it has none."""
        return _merge([e.agent.get_controller_state() for e in self._envs])

    def set_controller_state(self, state: dict) -> None:
        """Set every env's controller state from the rows of ``state`` (leaves [n, D])."""
        for i, e in enumerate(self._envs):
            e.agent.set_controller_state(_row(state, i))


class SerialEnvs:
    """n unwrapped single-environment ManiSkill envs seen as one env with ``num_envs = n``.

    ``step(actions, env_ids)`` steps only the environments ``env_ids`` (the others keep their
    state), and returns their rows only; ``reset`` and ``get_obs`` return every environment's
    observation. Attributes it does not define (control_mode, control_freq, ...) come from the
    first env.
    """

    def __init__(self, envs: list):
        self.envs = envs
        self.num_envs = len(envs)
        self._raw: list[dict] = [None] * len(envs)  # each environment's latest raw observation
        self._stale: set[int] = set()  # envs whose state was set after their latest observation
        self.agent = _SerialAgent(envs)

    def __getattr__(self, name):
        return getattr(self.__dict__["envs"][0], name)

    def step(self, actions: torch.Tensor, env_ids: list[int] | None = None):
        """actions: f32 [n, A] in ManiSkill's units, one row per entry of ``env_ids`` (all by
        default)."""
        ids = range(self.num_envs) if env_ids is None else env_ids
        rewards = []
        terminated = []
        truncated = []
        success = []
        for row, i in enumerate(ids):
            raw, r, term, trunc, info = self.envs[i].step(actions[row : row + 1])
            self._raw[i] = raw
            self._stale.discard(i)
            rewards.append(r)
            terminated.append(term)
            truncated.append(trunc)
            success.append(
                info["success"] if "success" in info else torch.zeros_like(term, dtype=torch.bool)
            )
        raw = _merge([self._raw[i] for i in ids])
        return (
            raw,
            torch.cat(rewards),
            torch.cat(terminated),
            torch.cat(truncated),
            {"success": torch.cat(success)},
        )

    def reset(self, seed: int | list[int] | None = None, options: dict | None = None):
        """Reset all environments, or ``options["env_idx"]``. An int seed gives environment i the
        seed ``seed + i`` (all of them ``seed`` with ``env_idx``); a list, as ManiSkill's, holds
        one seed per environment (``num_envs`` of them) and environment i gets ``seed[i]``.
        Returns the observation of every environment."""
        idx = (options or {}).get("env_idx")
        for i in _ids(idx, self.num_envs):
            if seed is None:
                s = None
            elif not isinstance(seed, int | np.integer):
                s = int(seed[i])
            else:
                s = int(seed) + (i if idx is None else 0)
            self._raw[i], _ = self.envs[i].reset(seed=s)
            self._stale.discard(i)
        return _merge(self._raw), {}

    # --- the batched env's state interface, one instance per row ---------------------------
    def get_state_dict(self) -> dict:
        """Every environment's ManiSkill state dict (actors, articulations and, where the
        controller keeps any, ``controller``), leaves [n, D]."""
        return _merge([e.get_state_dict() for e in self.envs])

    def set_state_dict(self, state: dict, env_idx: torch.Tensor | None = None) -> None:
        """Set environment ``env_idx[k]`` from row k of ``state`` (leaves [len(env_idx), D]; all
        environments by default). Like ManiSkill's, it sets actors and articulations only (not the
        controller: ``agent.set_controller_state``), and the observation is recomputed by the next
        ``get_obs``."""
        for row, i in enumerate(_ids(env_idx, self.num_envs)):
            self.envs[i].set_state_dict(_row(state, row))
            self._stale.add(i)

    def get_obs(self) -> dict:
        """Every environment's observation, recomputed for those set since their latest one."""
        for i in sorted(self._stale):
            self._raw[i] = self.envs[i].get_obs()
        self._stale.clear()
        return _merge(self._raw)

    @property
    def _batched_main_rng(self) -> list[np.random.RandomState]:
        """ManiSkill's per-environment main RNG (it draws the seed of an unseeded episode), one
        live RandomState per environment, as the rows of a batched env's ``BatchedRNG``."""
        return [e._batched_main_rng[0] for e in self.envs]

    @property
    def _batched_episode_rng(self) -> list[np.random.RandomState]:
        """ManiSkill's per-environment episode RNG, one live RandomState per environment."""
        return [e._batched_episode_rng[0] for e in self.envs]

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [n or N, H, W, 3]: every environment's frame, or only ``env_ids``'."""
        envs = self.envs if env_ids is None else [self.envs[i] for i in env_ids.tolist()]
        return torch.cat([e.render() for e in envs])

    def close(self) -> None:
        for e in self.envs:
            e.close()
