"""``SerialEnvs``: several single-environment physx_cpu ManiSkill envs behind the batched-env
interface that physx_cuda envs have, so that ``ManiSkillCore`` runs one code path on both.

physx_cpu simulates one environment per ManiSkill instance. Stepping n of them one after the
other and doing the observation mapping, time limits and resets once on the stacked batch costs
one set of tensor ops per worker step instead of one per environment (the per-op overhead of
torch on a few floats is larger than the arithmetic).
"""

from __future__ import annotations

import torch


def _merge(trees: list) -> dict | torch.Tensor:
    """Concatenate matching tensor leaves of several observation dicts along the batch dim."""
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(trees) if len(trees) > 1 else first
    return {k: _merge([t[k] for t in trees]) for k in first}


class SerialEnvs:
    """n unwrapped single-environment ManiSkill envs seen as one env with ``num_envs = n``.

    ``step(actions, env_ids)`` steps only the environments ``env_ids`` (the others keep their
    state), and returns their rows only; ``reset`` returns every environment's observation.
    Attributes it does not define (agent, control_mode, control_freq, ...) come from the first env.
    """

    def __init__(self, envs: list):
        self.envs = envs
        self.num_envs = len(envs)
        self._raw: list[dict] = [None] * len(envs)  # each environment's latest raw observation

    def __getattr__(self, name):
        return getattr(self.__dict__["envs"][0], name)

    def step(self, actions: torch.Tensor, env_ids: list[int] | None = None):
        """actions: f32 [n, A] in ManiSkill's units, one row per entry of ``env_ids`` (all by default)."""
        ids = range(self.num_envs) if env_ids is None else env_ids
        rewards, terminated, truncated, success = [], [], [], []
        for row, i in enumerate(ids):
            raw, r, term, trunc, info = self.envs[i].step(actions[row : row + 1])
            self._raw[i] = raw
            rewards.append(r), terminated.append(term), truncated.append(trunc)
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

    def reset(self, seed: int | None = None, options: dict | None = None):
        """Reset all environments, or ``options["env_idx"]``; an int seed gives environment i the
        seed ``seed + i``. Returns the observation of every environment."""
        idx = (options or {}).get("env_idx")
        ids = (
            range(self.num_envs) if idx is None else [int(i) for i in torch.as_tensor(idx).tolist()]
        )
        for i in ids:
            self._raw[i], _ = self.envs[i].reset(
                seed=None if seed is None else seed + (i if idx is None else 0)
            )
        return _merge(self._raw), {}

    def render(self) -> torch.Tensor:
        return torch.cat([e.render() for e in self.envs])  # uint8 [n, H, W, 3]

    def close(self) -> None:
        for e in self.envs:
            e.close()
