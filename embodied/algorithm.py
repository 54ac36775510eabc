"""What an RL algorithm is to the runner, and the minibatch update they share.

An algorithm plans its collection rounds (reset seeds, groups, chunks per round), turns a
``RolloutBatch`` into advantages and a sample mask (``advantages``), and scores a minibatch
(``loss``) through the learner. Both are built on the pure functions of ``embodied.algorithms``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from embodied.algorithms import EXPLAINED_VARIANCE_MOMENTS, explained_variance
from embodied.learner import TrainEngine, check_grad_norm
from embodied.rollout import LEVELS, CollectPlan, RolloutBatch, Samples, share_bounds


@dataclass
class AlgorithmConfig:
    name: str = ""  # selects the schema: ppo | grpo
    # the Gaussian head's log std after runner.init_from: SFT fits only the mean, and sampling at
    # the SFT's untrained std can fail most episodes the deterministic policy solves
    exploration_log_std: float | None = None

    def check_with(self, policy, env) -> None:
        """What the algorithm asks of the policy's and the environments' configs (ValueError
        naming the key): a Gaussian where ``exploration_log_std`` is set (a flow head failed
        only after the simulators were built)."""
        if self.exploration_log_std is not None and not policy.has_gaussian():
            head = f" (head {policy.head})" if hasattr(policy, "head") else ""
            raise ValueError(
                f"algorithm.exploration_log_std: sets a Gaussian head's log std, and policy "
                f"{policy.name!r}{head} samples otherwise; set algorithm.exploration_log_std=null "
                "(a flow's noise is policy.flow_noise_std)"
            )

    def fit_policy(self, policy: torch.nn.Module) -> None:
        """Ready the built policy for this algorithm (ValueError naming the key): the Gaussian's
        log std (a VLA's head's, the actor-critic's own) set to ``exploration_log_std`` where
        given."""
        if self.exploration_log_std is None:
            return
        owner = getattr(policy, "head", policy)
        log_std = getattr(owner, "log_std", None)
        if log_std is None:
            raise ValueError(
                "algorithm.exploration_log_std: the policy has no Gaussian head with a log_std"
            )
        with torch.no_grad():
            log_std.fill_(self.exploration_log_std)

    def keeps_reference(self) -> bool:
        """Whether the algorithm scores against the policy's starting weights (GRPO's KL
        reference), which a resume rebuilds from ``runner.init_from``."""
        return False

    def build(self, cfg, spec, task_of_env: torch.Tensor, policy=None) -> Algorithm:
        """The algorithm (``policy``: the learner's, for what it scores against)."""
        raise NotImplementedError


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"logprob_level: must be chunk, action or token, got {level!r}")


def check_clipping(clip_coef: float, clip_coef_high: float | None, max_grad_norm: float) -> None:
    """The ratio's clip range and the gradient's norm bound: 0 would leave nothing to learn."""
    if clip_coef <= 0:
        raise ValueError(f"clip_coef: must be > 0, got {clip_coef}")
    if clip_coef_high is not None and clip_coef_high <= 0:
        raise ValueError(f"clip_coef_high: must be > 0 or null, got {clip_coef_high}")
    check_grad_norm(max_grad_norm)


def check_behaviour_weight_cap(cap: float | None) -> None:
    # a cap of 1 or less would drop every entry the update has moved towards (weight > 1)
    if cap is not None and cap <= 1:
        raise ValueError(f"behaviour_weight_cap: must be > 1 or null, got {cap}")


class Algorithm(Protocol):
    has_critic: bool
    max_rounds: int  # collection rounds per update at most
    num_chunks: int  # chunks per round
    evaluates_before: bool  # evaluate before the first update (fine-tuning a trained policy)

    def notes(self) -> list[str]:
        """Lines the run prints once about how the algorithm uses the environments."""

    def plan(self, iteration: int, round_index: int, episode_base: int) -> CollectPlan: ...

    def advantages(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Set ``batch.advantages`` (and returns, sample_mask); return 0-dim tensor metrics."""

    def enough(self, metrics: list[dict[str, torch.Tensor]]) -> bool:
        """Whether the rounds collected so far (their advantages() metrics) make an update."""

    def collected(self, rounds: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """The iteration's metrics from its rounds' advantages() metrics, on the host."""

    def prepare(self, samples: Samples, learner: TrainEngine | None = None) -> None:
        """Per-batch work before the epochs (e.g. reference log-probabilities, once; each of
        ``learner``'s data-parallel ranks scores its share; None: one process)."""

    def loss(
        self, learner: TrainEngine, minibatch: Samples
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def stop_early(self, last_minibatch: dict[str, float]) -> bool: ...


def mean_over_rounds(
    rounds: list[dict[str, torch.Tensor]], summed: tuple[str, ...] = ()
) -> dict[str, float]:
    """Rounds' 0-dim metrics on the host (one transfer): those in ``summed`` added (counts), the
    others averaged (rates)."""
    if not rounds or not rounds[0]:
        return {}
    keys = list(rounds[0])
    table = torch.stack([torch.stack([r[k].float() for k in keys]) for r in rounds]).tolist()
    out = {}
    for j, key in enumerate(keys):
        column = [row[j] for row in table]
        out[key] = sum(column) if key in summed else sum(column) / len(column)
    return out


def broadcast(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-chunk advantages f32 [N] spread over a finer log-probability level's shape."""
    return advantages.view(-1, *([1] * (like.dim() - 1))).expand_as(like)


@torch.no_grad()
def in_pieces(
    samples: Samples,
    num_minibatches: int,
    score: Callable[[Samples], torch.Tensor],
    learner: TrainEngine | None = None,
) -> torch.Tensor:
    """``score`` of each minibatch-sized piece of ``samples``, in order, joined: a forward pass
    over the whole batch without holding all of its activations at once. With a data-parallel
    ``learner`` each rank scores only its contiguous share of the rows and the ranks gather
    the shares: every rank gets the whole result for 1/N of the forward passes."""
    n = len(samples)
    size = max(1, n // num_minibatches)
    first, end = 0, n
    sharded = learner is not None and learner.world_size > 1 and n >= learner.world_size
    if sharded:
        first, end = share_bounds(n, learner.rank, learner.world_size)
    parts = []
    for start in range(first, end, size):
        rows_host = torch.arange(start, min(end, start + size))
        piece = samples.index(rows_host.to(samples.advantages.device), rows_host)
        parts.append(score(piece))
    joined = torch.cat(parts)
    return learner.gather_shares(joined, n) if sharded else joined


def proximal_logprob(
    learner: TrainEngine, samples: Samples, *, level: str, num_minibatches: int
) -> torch.Tensor:
    """The samples' log-probabilities at ``level`` under the learner's current weights (the
    update's proximal policy); each data-parallel rank scores its share."""

    def score(piece: Samples) -> torch.Tensor:
        return learner.logprob(piece, level)[0]

    return in_pieces(samples, num_minibatches, score, learner)


def explained_variance_of_shares(
    keys: list[str], table: torch.Tensor
) -> tuple[list[str], torch.Tensor]:
    """The metric table ([minibatches, metrics], averaged over the data-parallel ranks) with
    the explained-variance moments the ranks reported (``value_loss``) made into each whole
    minibatch's ``value/explained_variance``; unchanged without them."""
    if EXPLAINED_VARIANCE_MOMENTS[0] not in keys:
        return keys, table
    moments = [table[:, keys.index(key)] for key in EXPLAINED_VARIANCE_MOMENTS]
    kept = [i for i, key in enumerate(keys) if key not in EXPLAINED_VARIANCE_MOMENTS]
    explained = explained_variance(*moments)  # f32 [minibatches]
    table = torch.cat([table[:, kept], explained[:, None]], dim=1)
    return [keys[i] for i in kept] + ["value/explained_variance"], table


def update(
    learner: TrainEngine,
    algorithm: Algorithm,
    samples: Samples,
    *,
    epochs: int,
    num_minibatches: int,
) -> dict[str, float]:
    """Epochs of shuffled minibatches; returns the mean of every metric and ``policy/epochs``.
    Metrics stay on the device during an epoch and cross to the host once at its end.

    Data-parallel (``learner.world_size`` > 1): every rank holds all ``samples`` and draws the
    same permutation (the same generator state), takes its share of each minibatch, and the
    learner averages the gradients; the step is the one-process step on the whole minibatch.
    Every rank sees the averaged metrics, so all of them stop early together."""
    n = len(samples)
    # num_minibatches near-equal parts, every sample in one (fewer samples: one sample each)
    parts = max(1, min(num_minibatches, n))
    device = samples.advantages.device
    sums: dict[str, float] = {}
    count = 0
    epochs_run = 0
    for _ in range(epochs):
        perm_host = torch.randperm(n)  # on the CPU: its slices also index the instructions
        perm = perm_host.to(device)
        epoch: list[dict[str, torch.Tensor]] = []
        for rows, rows_host in zip(perm.tensor_split(parts), perm_host.tensor_split(parts)):
            minibatch = samples.index(rows, rows_host)
            if learner.world_size > 1:  # data-parallel: this rank's share of the minibatch
                minibatch = minibatch.shard(learner.rank, learner.world_size)
            loss, metrics = algorithm.loss(learner, minibatch)
            learner.backward(loss)
            metrics["policy/grad_norm"] = learner.step()
            epoch.append(metrics)
        keys = list(epoch[0])
        table = torch.stack([torch.stack([m[k].float() for k in keys]) for m in epoch])
        table = learner.average(table)  # every rank's share: the whole minibatches' metrics
        keys, table = explained_variance_of_shares(keys, table)
        rows_host = table.tolist()  # the epoch's one transfer: [minibatches][metrics]
        for values in rows_host:
            for key, value in zip(keys, values):
                sums[key] = sums.get(key, 0.0) + value
        count += len(rows_host)
        epochs_run += 1
        if algorithm.stop_early(dict(zip(keys, rows_host[-1]))):
            break
    means = {k: v / count for k, v in sums.items()}
    means["policy/epochs"] = epochs_run
    return means
