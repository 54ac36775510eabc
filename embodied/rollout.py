"""Rollout collection: the policy and the environment workers in lockstep.

Each rollout step the policy acts on a batch of observations and returns a chunk of K actions;
the environment executes the K steps. Per chunk we keep the observation, the sampled output, its
log-probability and value; rewards are summed within the chunk with discount (``sum_k gamma^k r_k``)
and an episode that ends inside a chunk ends the chunk for that environment (the remaining actions
of the chunk run on the freshly reset episode and are not credited to either). ``next_values``
holds V(s_{t+1}), or V(final_obs) where an episode ended, so truncations bootstrap correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embodied.schema import Observation, PolicyOutput


@dataclass
class Rollout:
    """Time-major buffers, T chunks by B environments."""

    obs: Observation  # every tensor [T, B, ...]; instruction: the first step's list
    actions: torch.Tensor  # f32 [T, B, K, A]
    extras: dict[str, torch.Tensor]  # e.g. raw_actions f32 [T, B, K, A]
    logprobs: torch.Tensor  # f32 [T, B]
    values: torch.Tensor  # f32 [T, B]
    next_values: torch.Tensor  # f32 [T, B]
    rewards: torch.Tensor  # f32 [T, B], discounted sum over the chunk
    terminated: torch.Tensor  # bool [T, B]
    truncated: torch.Tensor  # bool [T, B]

    def store(
        self, t: int, obs: Observation, out: PolicyOutput, ids: torch.Tensor | slice = slice(None)
    ) -> None:
        """Write step t's observation and policy output into rows ``ids`` (all by default)."""
        for dst, src in zip(self.obs.tensors().values(), obs.tensors().values()):
            dst[t, ids] = src
        self.actions[t, ids], self.logprobs[t, ids], self.values[t, ids] = (
            out.actions,
            out.logprob,
            out.value,
        )
        for k, v in out.extras.items():
            self.extras[k][t, ids] = v

    def flat(self, idx: torch.Tensor) -> tuple[Observation, PolicyOutput]:
        """Samples ``idx`` (long [N]) of the flattened T*B batch, for a minibatch update."""

        def f(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, *t.shape[2:])[idx]

        obs = self.obs.map(f)
        obs.instruction = [
            self.obs.instruction[i % len(self.obs.instruction)] for i in idx.tolist()
        ]
        out = PolicyOutput(
            actions=f(self.actions),
            logprob=f(self.logprobs),
            value=f(self.values),
            extras={k: f(v) for k, v in self.extras.items()},
        )
        return obs, out


@dataclass
class EpisodeStats:
    """Running per-environment episode accumulators and the episodes finished so far."""

    returns: torch.Tensor
    lengths: torch.Tensor
    success: torch.Tensor
    finished: list[dict] = field(default_factory=list)

    @staticmethod
    def zeros(num_envs: int, device) -> EpisodeStats:
        return EpisodeStats(
            torch.zeros(num_envs, device=device),
            torch.zeros(num_envs, dtype=torch.long, device=device),
            torch.zeros(num_envs, dtype=torch.bool, device=device),
        )

    def record(
        self,
        reward: torch.Tensor,
        success: torch.Tensor,
        done: torch.Tensor,
        ids: torch.Tensor | None = None,
    ) -> None:
        """One environment step of all environments, or of ``ids`` (long [N]) only."""
        if ids is not None:
            done_all = torch.zeros_like(self.success)
            done_all[ids] = done
            self.returns[ids] += reward
            self.lengths[ids] += 1
            self.success[ids] |= success
            done = done_all
        else:
            self.returns += reward
            self.lengths += 1
            self.success |= success
        if bool(done.any()):
            # gather on the device, one transfer per field (no per-element host syncs)
            rets, lens, wins = (
                self.returns[done].tolist(),
                self.lengths[done].tolist(),
                self.success[done].tolist(),
            )
            envs = done.nonzero().squeeze(1).tolist()
            self.finished += [
                {"return": r, "length": n, "success": w, "env": e}
                for r, n, w, e in zip(rets, lens, wins, envs)
            ]
            self.returns[done], self.lengths[done], self.success[done] = 0.0, 0, False

    def summary(self) -> dict[str, float]:
        if not self.finished:
            return {}
        n = len(self.finished)
        return {
            "episode/return": sum(e["return"] for e in self.finished) / n,
            "episode/length": sum(e["length"] for e in self.finished) / n,
            "episode/success_once": sum(e["success"] for e in self.finished) / n,
            "episode/count": n,
        }


def execute_chunk(env, actions: torch.Tensor, gamma: float, stats: EpisodeStats | None = None):
    """Run a chunk (f32 [B, K, A]) -> (next obs, reward [B], terminated [B], truncated [B], final_obs)."""
    B, K = actions.shape[:2]
    if K == 1:  # the common case, without the chunk bookkeeping
        out = env.step(actions[:, 0])
        if stats is not None:
            stats.record(out.reward, out.success, out.terminated | out.truncated)
        return out.obs, out.reward, out.terminated, out.truncated, out.final_obs
    reward = torch.zeros(B, device=env.device)
    terminated = torch.zeros(B, dtype=torch.bool, device=env.device)
    truncated = torch.zeros_like(terminated)
    alive = torch.ones_like(terminated)
    final_obs = None
    for k in range(K):
        out = env.step(actions[:, k])
        reward += (gamma**k) * out.reward * alive
        ended = (out.terminated | out.truncated) & alive
        if stats is not None:
            stats.record(out.reward * alive, out.success & alive, ended)
        if out.final_obs is not None and bool(ended.any()):
            final_obs = (
                out.final_obs if final_obs is None else out.final_obs.where(ended, final_obs)
            )
        terminated |= out.terminated & alive
        truncated |= out.truncated & alive
        alive &= ~ended
        obs = out.obs
    return obs, reward, terminated, truncated, final_obs


def _with_value(out: PolicyOutput) -> PolicyOutput:
    """Policies without a critic (GRPO) report value None; the buffers hold zeros instead."""
    if out.value is None:
        out.value = torch.zeros_like(out.logprob)
    return out


def _alloc_like(t: torch.Tensor, T: int, B: int | None = None) -> torch.Tensor:
    return torch.empty((T, B or t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)


def _alloc(obs: Observation, out: PolicyOutput, T: int, B: int, device) -> Rollout:
    """Preallocate [T, B, ...] buffers from one step's shapes (which may cover fewer than B envs)."""
    return Rollout(
        obs=obs.map(lambda x: _alloc_like(x, T, B)),
        actions=_alloc_like(out.actions, T, B),
        extras={k: _alloc_like(v, T, B) for k, v in out.extras.items()},
        logprobs=_alloc_like(out.logprob, T, B),
        values=_alloc_like(out.value, T, B),
        next_values=_alloc_like(out.value, T, B),
        rewards=_alloc_like(out.value, T, B),
        terminated=torch.empty((T, B), dtype=torch.bool, device=device),
        truncated=torch.empty((T, B), dtype=torch.bool, device=device),
    )


@torch.no_grad()
def collect(
    env,
    policy,
    obs: Observation,
    *,
    num_steps: int,
    gamma: float,
    stats: EpisodeStats,
    stages: int = 1,
):
    """Collect ``num_steps`` chunks from ``obs``. Returns (Rollout, the observation after it).
    ``stages`` > 1 pipelines: the environments are split into that many groups and the policy
    acts for one group while the workers simulate the others (environments with ``step_async``,
    chunks of one action); environments that cannot step a subset fall back to lockstep."""
    if stages > 1 and hasattr(env, "step_async") and getattr(env, "can_step_subsets", True):
        return _collect_pipelined(env, policy, obs, num_steps=num_steps, stats=stats, stages=stages)
    T = num_steps
    buf: Rollout | None = None
    for t in range(T):
        out = _with_value(policy.act(obs))
        if buf is None:  # preallocate [T, B, ...] from the first step's shapes
            buf = _alloc(obs, out, T, env.num_envs, env.device)
        buf.store(t, obs, out)
        obs, reward, term, trunc, final_obs = execute_chunk(
            env, out.actions.to(env.device), gamma, stats
        )
        buf.rewards[t], buf.terminated[t], buf.truncated[t] = reward, term, trunc
        if t > 0:
            buf.next_values[t - 1] = torch.where(
                buf.terminated[t - 1] | buf.truncated[t - 1], buf.next_values[t - 1], out.value
            )
        # V(final_obs) where an episode ended; V(s_{t+1}) is filled in at the next step
        buf.next_values[t] = policy.value(final_obs) if final_obs is not None else 0.0
    last = policy.value(obs)
    buf.next_values[T - 1] = torch.where(
        buf.terminated[T - 1] | buf.truncated[T - 1], buf.next_values[T - 1], last
    )
    return buf, obs


def _collect_pipelined(
    env, policy, obs: Observation, *, num_steps: int, stats: EpisodeStats, stages: int
):
    """``collect`` with the environments split into ``stages`` groups: while the workers step
    group g, the main process runs the policy for the group that just returned (K = 1).
    Groups interleave (env i is in group i % stages), so every worker holds some of each group
    and always has the next group's request queued when it finishes one: no worker waits for
    the policy."""
    T, B = num_steps, env.num_envs
    groups = [
        g for g in (torch.arange(s, B, stages, device=env.device) for s in range(stages)) if len(g)
    ]
    buf: Rollout | None = None
    outs: list[PolicyOutput] = []
    last_obs: list[Observation] = []

    def act_and_send(t: int, ids: torch.Tensor, o: Observation) -> PolicyOutput:
        nonlocal buf
        out = _with_value(policy.act(o))
        if out.actions.shape[1] != 1:
            raise ValueError(
                "pipelined collection executes chunks of one action; use stages=1 for K > 1"
            )
        env.step_async(out.actions[:, 0].to(env.device), ids)
        if buf is None:
            buf = _alloc(o, out, T, B, env.device)
        buf.store(t, o, out, ids)
        return out

    for ids in groups:  # fill the pipeline
        outs.append(act_and_send(0, ids, obs.index(ids)))
    for t in range(T):
        for g, ids in enumerate(groups):
            step = env.step_wait(ids)
            done = step.terminated | step.truncated
            stats.record(step.reward, step.success, done, ids)
            buf.rewards[t, ids], buf.terminated[t, ids], buf.truncated[t, ids] = (
                step.reward,
                step.terminated,
                step.truncated,
            )
            final_v = policy.value(step.final_obs) if step.final_obs is not None else None
            if t + 1 < T:
                nxt = act_and_send(
                    t + 1, ids, step.obs
                ).value  # V(s_{t+1}) comes with the next action
            else:
                nxt = policy.value(step.obs)
                last_obs.append(step.obs)
            # V(final_obs) where an episode ended, V(s_{t+1}) elsewhere
            buf.next_values[t, ids] = (
                torch.where(done, final_v, nxt) if final_v is not None else nxt
            )
    last = Observation.cat(last_obs)  # rows in group order -> environment order
    return buf, last.index(torch.cat(groups).argsort())
