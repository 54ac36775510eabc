"""Rollout collection: the inference policy and the environment group in lockstep (or pipelined),
and rollout data that says what it is.

Each rollout step the policy acts on a batch of observations and returns a chunk of K actions;
the environment group executes them. ``RolloutBatch`` keeps, per step and environment, which
episode, GRPO group, task and policy version the chunk belongs to, and per action whether it ran
in that episode (``valid``). Advantages, loss masks, chunk discounting, groups and per-task
statistics are computed from these fields, never from column positions.

Nothing here reads a device tensor on the host: episode statistics accumulate on the device, and
the rows whose episode ended come from the environment (``ChunkStep.ended``, on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from embodied.env_group import ChunkStep, EnvGroup
from embodied.episode_stats import EpisodeStats
from embodied.inference import InferencePolicy
from embodied.run import Interrupted
from embodied.schema import Observation, PolicyOutput, host_to_device

LEVELS = ("chunk", "action", "token")


@dataclass
class RolloutBatch:
    """T rollout steps (chunks) by B environments, time-major, on the policy's device."""

    obs: Observation  # every tensor [T, B, ...]; instruction unused: see task_id / instructions
    instructions: tuple[str, ...]  # task_id -> the instruction the policy saw
    actions: torch.Tensor  # f32 [T, B, K, A]
    extras: dict[str, torch.Tensor]  # what evaluate() needs again, [T, B, ...]
    logprob_token: torch.Tensor  # f32 [T, B, K, A] behaviour log-probability per action dimension
    values: torch.Tensor  # f32 [T, B] V(s_t) (zeros without a critic)
    next_values: torch.Tensor  # f32 [T, B] V(s_{t+1}), or V(last obs) where the episode ended
    rewards: torch.Tensor  # f32 [T, B, K] per environment step
    terminated: torch.Tensor  # bool [T, B, K]
    truncated: torch.Tensor  # bool [T, B, K]
    success: torch.Tensor  # bool [T, B, K]
    valid: torch.Tensor  # bool [T, B, K] action k ran in the episode chunk t started in
    episode_id: torch.Tensor  # long [T, B] the episode chunk t started in (unique in a run)
    group_id: torch.Tensor  # long [T, B] its GRPO group (episodes sharing a reset seed), -1: none
    task_id: torch.Tensor  # long [T, B] index into the env group's tasks and ``instructions``
    policy_version: torch.Tensor  # long [T, B] the weight version that chose the chunk
    # set by an algorithm's advantages(): what enters the update
    advantages: torch.Tensor | None = None  # f32 [T, B]
    returns: torch.Tensor | None = None  # f32 [T, B] (algorithms with a critic)
    sample_mask: torch.Tensor | None = None  # bool [T, B] chunks that enter the update

    @property
    def executed(self) -> torch.Tensor:
        """long [T, B]: the chunk's actions that ran in its episode."""
        return self.valid.sum(-1)

    @property
    def chunk_done(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(terminated, truncated) of the chunk's episode within the chunk: bool [T, B] each."""
        terminated = (self.terminated & self.valid).any(-1)
        truncated = (self.truncated & self.valid).any(-1) & ~terminated
        return terminated, truncated

    @staticmethod
    def cat_envs(parts: list[RolloutBatch]) -> RolloutBatch:
        """The batches of consecutive environment rows side by side: [T, B1 + B2 + ..., ...]
        (what env workers collected apart; advantages are computed after)."""
        first = parts[0]

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in parts], dim=1)

        tensors = {
            f.name: cat(f.name)
            for f in fields(first)
            if isinstance(getattr(first, f.name), torch.Tensor)
        }
        obs = [p.obs.tensors() for p in parts]
        joined = {name: torch.cat([o[name] for o in obs], dim=1) for name in obs[0]}
        return RolloutBatch(
            obs=Observation(
                state=joined["state"],
                instruction=[],
                images={k: joined[f"images/{k}"] for k in first.obs.images},
                privileged={k: joined[f"privileged/{k}"] for k in first.obs.privileged},
            ),
            instructions=first.instructions,
            extras={k: torch.cat([p.extras[k] for p in parts], dim=1) for k in first.extras},
            **tensors,
        )

    def samples(self) -> Samples:
        """The chunks of ``sample_mask`` flattened to [N, ...] for minibatch updates (once per
        update, two host syncs: the count N and the samples' task ids)."""
        mask = self.sample_mask.reshape(-1)
        rows = mask.nonzero().squeeze(1)  # long [N]

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, *t.shape[2:])[rows]

        obs = self.obs.map(flat)
        obs.instruction = [self.instructions[i] for i in flat(self.task_id).tolist()]
        output = PolicyOutput(
            actions=flat(self.actions),
            logprob=flat(self.logprob_token.sum((2, 3))),
            value=flat(self.values),
            extras={k: flat(v) for k, v in self.extras.items()},
        )
        returns = self.returns if self.returns is not None else self.values
        return Samples(
            obs=obs,
            output=output,
            logprob_token=flat(self.logprob_token),
            valid=flat(self.valid),
            advantages=flat(self.advantages),
            returns=flat(returns),
            values=flat(self.values),
            policy_version=flat(self.policy_version),
        )


def share_bounds(total: int, index: int, parts: int) -> tuple[int, int]:
    """[first, end) of part ``index`` when ``total`` rows are cut into ``parts`` contiguous
    parts whose sizes differ by one at most (a data-parallel rank's rows, an evaluation
    worker's episodes)."""
    return total * index // parts, total * (index + 1) // parts


@dataclass
class Share:
    """What a data-parallel rank's rows are a share of."""

    whole: Samples  # the minibatch
    world_size: int  # how many ranks share it


NOT_ROWS = ("obs", "output", "share")  # the fields of Samples that are not plain [N, ...] tensors


@dataclass
class Samples:
    """N chunks for an update, every tensor [N, ...] on the policy's device."""

    obs: Observation  # instruction: list of N strings
    output: PolicyOutput  # what the behaviour policy sampled (actions, extras)
    logprob_token: torch.Tensor  # f32 [N, K, A] behaviour log-probability per action dimension
    valid: torch.Tensor  # bool [N, K]
    advantages: torch.Tensor  # f32 [N]
    returns: torch.Tensor  # f32 [N]
    values: torch.Tensor  # f32 [N]
    policy_version: torch.Tensor  # long [N] the weight version that chose the chunk
    ref_logprob: torch.Tensor | None = None  # reference policy, at the update's level (GRPO KL)
    # the weights the update started from, at the update's level (decoupled PPO: data collected
    # by older weights, cluster.max_staleness > 0)
    prox_logprob: torch.Tensor | None = None
    # this minibatch is one data-parallel rank's rows of ``share.whole`` (``shard``)
    share: Share | None = None

    def __len__(self) -> int:
        return self.advantages.shape[0]

    def shard(self, rank: int, world_size: int) -> Samples:
        """Rank ``rank``'s contiguous share of these rows out of ``world_size``; its means
        take this minibatch's denominators (``mean_count``)."""
        n = len(self)
        if n < world_size:
            raise ValueError(
                f"a minibatch of {n} samples cannot be shared by {world_size} actor workers; "
                "use fewer algorithm.num_minibatches or cluster.actor.workers"
            )
        rows_host = torch.arange(*share_bounds(n, rank, world_size))
        part = self.index(rows_host.to(self.advantages.device), rows_host)
        part.share = Share(whole=self, world_size=world_size)
        return part

    def whole(self) -> Samples:
        """The minibatch these rows are a share of (themselves when not a share)."""
        return self if self.share is None else self.share.whole

    def mean_count(self, level: str | None) -> torch.Tensor | float | None:
        """The denominator of a mean over these rows' entries at ``level`` (None: one entry
        per row) when they are a rank's share: the whole minibatch's count over the ranks, so
        that the ranks' averaged gradient is the whole minibatch's. None when whole."""
        if self.share is None:
            return None
        whole = self.share.whole
        mask = None if level is None else whole.mask(level)
        if mask is None:
            return len(whole) / self.share.world_size
        return mask.sum().clamp(min=1).to(torch.float32) / self.share.world_size

    def mask(self, level: str) -> torch.Tensor | None:
        """Which log-probability entries count: bool [N, K] (action), [N, K, A] (token); None at
        chunk level, where the invalid actions are already summed out."""
        if level == "chunk":
            return None
        if level == "action":
            return self.valid
        return self.valid[..., None].expand_as(self.logprob_token)

    def behaviour_logprob(self, level: str) -> torch.Tensor:
        """The behaviour log-probability at ``level``: f32 [N] (the valid actions of the chunk),
        [N, K] or [N, K, A]."""
        return logprob_at(self.logprob_token, level, self.valid)

    def index(self, rows: torch.Tensor, rows_host: torch.Tensor) -> Samples:
        """Rows ``rows`` (long, on the device) and the same ``rows_host`` (on the CPU, for the
        instructions) of every field."""
        obs = self.obs.map(lambda t: t[rows])
        obs.instruction = [self.obs.instruction[i] for i in rows_host.tolist()]
        output = PolicyOutput(
            actions=self.output.actions[rows],
            logprob=self.output.logprob[rows],
            value=self.output.value[rows],
            extras={k: v[rows] for k, v in self.output.extras.items()},
        )
        tensors = {
            f.name: getattr(self, f.name)[rows]
            for f in fields(self)
            if f.name not in NOT_ROWS and getattr(self, f.name) is not None
        }
        return Samples(obs=obs, output=output, **tensors)

    @staticmethod
    def cat(parts: list[Samples]) -> Samples:
        first = parts[0]
        tensors = {
            f.name: torch.cat([getattr(p, f.name) for p in parts])
            for f in fields(first)
            if f.name not in NOT_ROWS and getattr(first, f.name) is not None
        }
        output = PolicyOutput(
            actions=torch.cat([p.output.actions for p in parts]),
            logprob=torch.cat([p.output.logprob for p in parts]),
            value=torch.cat([p.output.value for p in parts]),
            extras={k: torch.cat([p.output.extras[k] for p in parts]) for k in first.output.extras},
        )
        return Samples(obs=Observation.cat([p.obs for p in parts]), output=output, **tensors)


def logprob_at(logprob_token: torch.Tensor, level: str, valid: torch.Tensor) -> torch.Tensor:
    """Per-dimension log-probabilities f32 [N, K, A] -> f32 [N] (chunk: the sum over the valid
    actions), [N, K] (action) or [N, K, A] (token)."""
    if level not in LEVELS:
        raise ValueError(f"logprob_level: must be one of {LEVELS}, got {level!r}")
    if level == "token":
        return logprob_token
    per_action = logprob_token.sum(-1)  # f32 [N, K]
    if level == "action":
        return per_action
    # where, not a product: an action that ran after its episode ended must not reach the sum
    return torch.where(valid, per_action, torch.zeros_like(per_action)).sum(-1)


@dataclass
class CollectPlan:
    """How one collection round starts: reset seeds and the GRPO group of each environment."""

    seeds: int | list[int]  # an int gives env b the seed seeds + b
    group_of_env: torch.Tensor  # long [B] on the CPU, -1 where the env is in no group
    num_chunks: int  # T
    episode_base: int  # episode ids of this round start here
    # a part of the run's environments (``part``): the first one's row and how many there are
    first_env: int = 0
    total_envs: int | None = None  # None: these B are all of them

    def part(self, lo: int, hi: int) -> CollectPlan:
        """The plan of environments ``[lo, hi)`` of these, collected apart (an env worker with
        inference in its process): their seeds and groups, and episode ids as the whole has."""
        B = len(self.group_of_env)
        seeds = self.seeds + lo if isinstance(self.seeds, int) else list(self.seeds[lo:hi])
        return CollectPlan(
            seeds=seeds,
            group_of_env=self.group_of_env[lo:hi],
            num_chunks=self.num_chunks,
            episode_base=self.episode_base,
            first_env=self.first_env + lo,
            total_envs=self.total_envs or B,
        )


def _alloc(obs: Observation, out: PolicyOutput, T: int, B: int) -> RolloutBatch:
    """Preallocate [T, B, ...] buffers from one step's shapes (which may cover fewer than B)."""

    def like(t: torch.Tensor, *tail: int, dtype=None) -> torch.Tensor:
        shape = (T, B, *(tail if tail else t.shape[1:]))
        return torch.empty(shape, dtype=dtype or t.dtype, device=t.device)

    K = out.actions.shape[1]
    logprob_token = out.extras.get("logp_token")
    if logprob_token is None:
        raise ValueError(
            "the policy's act() must return extras['logp_token'] (f32 [B, K, A]): the update "
            "takes ratios per chunk, action or token"
        )
    flag = torch.bool
    empty = torch.empty(0, dtype=torch.long)
    return RolloutBatch(
        obs=obs.map(lambda t: like(t)),
        instructions=(),
        actions=like(out.actions),
        extras={k: like(v) for k, v in out.extras.items() if k != "logp_token"},
        logprob_token=like(logprob_token),
        values=like(out.value),
        next_values=like(out.value),
        rewards=like(out.value, K),
        terminated=like(out.value, K, dtype=flag),
        truncated=like(out.value, K, dtype=flag),
        success=like(out.value, K, dtype=flag),
        # what follows from the round's ends and versions: made after it (_fill_round)
        valid=empty,
        episode_id=empty,
        group_id=empty,
        task_id=empty,
        policy_version=empty,
    )


@torch.no_grad()
def collect(
    envs: EnvGroup,
    policy: InferencePolicy,
    obs: Observation,
    plan: CollectPlan,
    stats: EpisodeStats,
    *,
    stages: int = 1,
    chunk_size: int = 1,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[RolloutBatch, Observation]:
    """Collect ``plan.num_chunks`` chunks from ``obs`` (the group's observation after its reset).
    Returns (RolloutBatch, the observation after it). ``stages`` > 1 pipelines: the environments
    are split into that many groups and the policy acts for one while the others simulate, where
    the environment group can split chunks of ``chunk_size`` actions so (``stage_split``);
    otherwise lockstep.
    ``should_stop`` is asked before every chunk; when it says so, ``Interrupted`` is raised."""
    T = plan.num_chunks
    # (a slice of the buffers per stage: views, plain copies, no index gathers)
    stage_list = envs.stage_split(stages, chunk_size)
    buffers = _RoundBuffers(envs, policy, T)
    for stage in stage_list:  # fill the pipeline (lockstep: the single stage)
        rows = stage[0]
        buffers.act(0, stage, obs if rows is None else obs.index(rows))
    last_obs: list[Observation] = []
    for t in range(T):
        if should_stop is not None and should_stop():
            for rows, _ in stage_list:  # let the environments finish what they were sent
                envs.receive(rows)
            raise Interrupted
        for stage in stage_list:
            step = envs.receive(stage[0])
            buffers.record(t, stage, step)
            if t + 1 < T:
                buffers.act(t + 1, stage, step.obs)
            else:
                last_obs.append(step.obs)
    if stage_list[0][0] is not None:  # rows in stage order -> environment order
        order = torch.cat([rows for rows, _ in stage_list]).argsort()
        last = Observation.cat(last_obs).index(order)
    else:
        last = last_obs[0]
    return buffers.finish(plan, stats, last), last


class _RoundBuffers:
    """A round's buffers, written chunk by chunk for a stage's rows (a CPU index, None: all, and
    the same rows as a slice of the buffers); allocated at the first chunk the policy chose."""

    def __init__(self, envs: EnvGroup, policy: InferencePolicy, T: int):
        B = envs.num_envs
        self.envs = envs
        self.policy = policy
        self.T = T
        self.device = policy.device
        self.buf: RolloutBatch | None = None
        # the weight version that chose each chunk: long [T, B] on the host, sent once at the end
        self.version_host = torch.empty(T, B, dtype=torch.long)
        self.bootstrap = torch.zeros(T, B, device=self.device)  # V(last obs) of ended episodes
        self.has_critic = getattr(policy, "has_critic", True)  # (without one, every V is 0)

    def act(self, t: int, stage: tuple[torch.Tensor | None, slice], obs: Observation) -> None:
        """The policy's chunk t for the stage's rows, kept and sent to their environments."""
        rows, at = stage
        obs = obs.to(self.device)
        out = self.policy.act(obs)
        if self.buf is None:
            self.buf = _alloc(obs, out, self.T, self.envs.num_envs)
        buf = self.buf
        destination = buf.obs.tensors()
        for name, t_obs in obs.tensors().items():
            destination[name][t, at] = t_obs
        buf.actions[t, at] = out.actions  # f32 [n, K, A]
        buf.logprob_token[t, at] = out.extras["logp_token"]  # f32 [n, K, A]
        for k, v in out.extras.items():
            if k != "logp_token":
                buf.extras[k][t, at] = v
        buf.values[t, at] = out.value  # f32 [n]
        self.version_host[t, at] = self.policy.version
        self.envs.send(out.actions.to(self.envs.device), rows)

    def record(self, t: int, stage: tuple[torch.Tensor | None, slice], step: ChunkStep) -> None:
        """What chunk t did in the stage's rows; the critic's bootstrap where episodes ended."""
        rows, at = stage
        step = _on(step, self.device)
        buf = self.buf
        buf.rewards[t, at] = step.reward
        buf.terminated[t, at] = step.terminated
        buf.truncated[t, at] = step.truncated
        buf.success[t, at] = step.success
        if step.final_obs is not None and self.has_critic:  # (no critic: no copy for zeros)
            global_rows = step.ended if rows is None else rows[step.ended]
            # the critic's bootstrap only on the rows that ended (their episode's last obs)
            rows_here = host_to_device(global_rows, self.device)
            self.bootstrap[t, rows_here] = self.policy.value(step.final_obs.to(self.device))

    def finish(self, plan: CollectPlan, stats: EpisodeStats, last: Observation) -> RolloutBatch:
        """The round's batch, once every chunk is recorded; ``last``: the observation after it."""
        buf = self.buf
        buf.instructions = self.envs.instructions
        done = _fill_round(buf, plan, host_to_device(self.envs.task_ids, self.device), stats)
        buf.policy_version = host_to_device(self.version_host, self.device)
        # V(s_{t+1}): the next chunk's value, V(s_T) after the last; V(last obs) where it ended
        if self.has_critic:
            after = self.policy.value(last.to(self.device))  # f32 [B]
        else:  # (a copy of the last observation for zeros: none)
            after = torch.zeros_like(buf.values[0])
        following = torch.cat([buf.values[1:], after[None]])
        ended = done & buf.valid
        buf.next_values = torch.where(ended.any(-1), self.bootstrap, following)
        return buf


def _fill_round(
    buf: RolloutBatch, plan: CollectPlan, task_ids: torch.Tensor, stats: EpisodeStats
) -> torch.Tensor:
    """What follows from the round's ends, for all its chunks at once (a fixed number of
    operations per round, none per step): ``valid``, episode and group ids, task ids, and the
    episode statistics. task_ids: long [B] on the buffers' device. Returns the ends, bool
    [T, B, K] (terminated or truncated)."""
    T, B, K = buf.terminated.shape
    device = buf.terminated.device
    done = buf.terminated | buf.truncated  # bool [T, B, K]
    done_long = done.long()
    buf.valid = done_long.cumsum(2) - done_long == 0  # no end before the action in its chunk
    ends = done_long.sum(2)  # long [T, B]: every end counts, a second one in a chunk too
    count = ends.cumsum(0) - ends  # long [T, B]: episodes ended before the chunk
    total_envs = plan.total_envs or B  # (episode ids: B of a larger whole, from first_env)
    env_index = torch.arange(plan.first_env, plan.first_env + B, device=device)
    buf.episode_id = plan.episode_base + count * total_envs + env_index
    group_of_env = host_to_device(plan.group_of_env, device)
    buf.group_id = torch.where(count == 0, group_of_env, -1)
    buf.task_id = task_ids.expand(T, B).clone()

    def in_time_order(x: torch.Tensor) -> torch.Tensor:  # [T, B, K] -> [T * K, B]
        return x.transpose(1, 2).reshape(T * K, B)

    stats.record(
        task_ids, in_time_order(buf.rewards), in_time_order(done), in_time_order(buf.success)
    )
    return done


def _on(step: ChunkStep, device: torch.device) -> ChunkStep:
    if step.reward.device == device:
        return step
    return ChunkStep(
        obs=step.obs,
        reward=step.reward.to(device),
        terminated=step.terminated.to(device),
        truncated=step.truncated.to(device),
        success=step.success.to(device),
        ended=step.ended,
        final_obs=step.final_obs,
    )
