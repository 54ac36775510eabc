"""Data-parallel updates: each rank takes its share of every minibatch, and the averaged
gradient is the whole minibatch's, however the rows and the masked actions fall between ranks.

The batches are collected on the bookkeeping task (tests/test_grpo_bookkeeping.py): chunks of
two actions, and an episode that ends inside a chunk, so that some actions count for nothing.
"""

import pytest
import torch
import torch.multiprocessing as mp
from scripted_envs import prepared_samples
from test_grpo_bookkeeping import MAX_STEPS, K, make_env

from embodied.algorithm import explained_variance_of_shares, proximal_logprob, update
from embodied.env_group import EnvGroup
from embodied.grpo import GRPO, GRPOConfig
from embodied.learner import TorchEngine
from embodied.models import ActorCritic, ActorCriticConfig
from embodied.ppo import PPO, PPOConfig


def policy_and_envs(seed: int = 0):
    torch.manual_seed(seed)
    env = make_env()
    config = ActorCriticConfig(hidden_sizes=[16], chunk_size=K, normalize_obs=False)
    return ActorCritic(env.spec, config), EnvGroup(env)


def algorithm_for(name: str, envs, policy):
    if name == "ppo":
        config = PPOConfig(
            num_steps=3, logprob_level="token", vf_clip=0.2, ent_coef=0.01, target_kl=None
        )
        return PPO(config, seed=0, num_envs=envs.num_envs)
    config = GRPOConfig(group_size=3, kl_coef=0.1, logprob_level="action")
    return GRPO(
        config,
        seed=100,
        task_of_env=envs.task_of_env,
        chunk_size=K,
        max_episode_steps=MAX_STEPS,
        policy=policy,
    )


def samples_for(name: str, seed: int = 0):
    """(policy, algorithm, samples with advantages and prepared): one round on the task. The
    policy has a trainable layer its forward never uses (as a text encoder's pooler)."""
    policy, envs = policy_and_envs(seed)
    policy.unused = torch.nn.Linear(2, 2)
    algorithm = algorithm_for(name, envs, policy)
    return policy, algorithm, prepared_samples(envs, policy, algorithm)


def gradients(engine, algorithm, minibatch) -> tuple[list[torch.Tensor], dict[str, float]]:
    loss, metrics = algorithm.loss(engine, minibatch)
    loss.backward()
    # (the unused layer, and GRPO's critic, get no gradient)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in engine.params]
    engine.optimizer.zero_grad(set_to_none=True)
    return grads, {k: v.item() for k, v in metrics.items()}


@pytest.mark.parametrize("name", ["ppo", "grpo"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_ranks_averaged_gradient_is_the_whole_minibatchs(name, world_size):
    policy, algorithm, samples = samples_for(name)
    engine = TorchEngine(policy, learning_rate=1e-3, max_grad_norm=1.0)
    # the shares differ in rows and in the actions that count
    valid = [samples.shard(r, world_size).valid.sum().item() for r in range(world_size)]
    assert len(set(valid)) > 1
    whole_grads, whole_metrics = gradients(engine, algorithm, samples)
    shares = [
        gradients(engine, algorithm, samples.shard(rank, world_size)) for rank in range(world_size)
    ]
    for i, whole in enumerate(whole_grads):
        averaged = sum(grads[i] for grads, _ in shares) / world_size
        torch.testing.assert_close(averaged, whole, rtol=1e-5, atol=1e-7)
    assert max(g.abs().max().item() for g in whole_grads) > 1e-3  # the loss moves the weights
    # every metric averaged over the ranks, as the update averages them; the explained
    # variance (no mean over entries) is made from the moments the ranks report
    keys = list(shares[0][1])
    averaged = [sum(metrics[key] for _, metrics in shares) / world_size for key in keys]
    keys, table = explained_variance_of_shares(keys, torch.tensor([averaged], dtype=torch.float64))
    averaged_metrics = dict(zip(keys, table[0].tolist()))
    assert sorted(averaged_metrics) == sorted(whole_metrics)
    for key, value in whole_metrics.items():
        assert averaged_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    if name == "ppo":  # the critic explains some of the returns' variance, and not all
        assert 0.01 < abs(whole_metrics["value/explained_variance"]) < 0.99


def test_a_minibatch_smaller_than_the_ranks_is_refused():
    _, _, samples = samples_for("ppo")
    few = samples.index(torch.arange(2), torch.arange(2))
    with pytest.raises(ValueError, match="a minibatch of 2 samples cannot be shared by 3"):
        few.shard(0, 3)


def count_rows(engine) -> list[int]:
    """The rows of every minibatch the engine scores from here on (a list it appends to)."""
    scored = []
    logprob = engine.logprob

    def counting(samples, level):
        scored.append(len(samples))
        return logprob(samples, level)

    engine.logprob = counting
    return scored


def prepare_and_update(engine, algorithm, samples) -> dict:
    """GRPO's reference log-probabilities and decoupled PPO's proximal ones (each rank scores
    its share of the batch), then two epochs of two minibatches."""
    samples.ref_logprob = None
    algorithm.prepare(samples, engine)
    level = algorithm.cfg.logprob_level
    samples.prox_logprob = proximal_logprob(engine, samples, level=level, num_minibatches=2)
    torch.manual_seed(7)
    return update(engine, algorithm, samples, epochs=2, num_minibatches=2)


def _rank_update(rank: int, world_size: int, name: str, address: str, out: str) -> None:
    """One rank of a data-parallel update: the same samples and generator state everywhere."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world_size)
    try:
        policy, algorithm, samples = samples_for(name)
        engine = TorchEngine(policy, learning_rate=1e-2, max_grad_norm=0.5)
        engine.distribute(dist.group.WORLD, with_value=algorithm.has_critic)
        scored = count_rows(engine)
        metrics = prepare_and_update(engine, algorithm, samples)
        result = {
            "state": policy.state_dict(),
            "metrics": metrics,
            "scored": scored,
            "prox": samples.prox_logprob,
            "ref": samples.ref_logprob,
        }
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


# (PPO's shares are checked by hand above; its two processes take 6 s)
@pytest.mark.parametrize("name", [pytest.param("ppo", marks=pytest.mark.slow), "grpo"])
def test_two_gloo_ranks_update_as_one_process_does(name, tmp_path):
    """torch DDP over gloo, two processes: the proximal and reference log-probabilities (each
    rank scored half of the batch), the weights after two epochs of two minibatches and the
    metrics are the one-process update's."""
    torch.set_num_threads(1)
    policy, algorithm, samples = samples_for(name)
    engine = TorchEngine(policy, learning_rate=1e-2, max_grad_norm=0.5)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    scored = count_rows(engine)
    alone = prepare_and_update(engine, algorithm, samples)
    out = str(tmp_path / "rank")
    address = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank_update, args=(2, name, address, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    # the proximal log-probabilities, in minibatch-sized pieces: each rank scored its half of
    # the batch; then the 4 minibatches (2 epochs of 2), each rank its half of each
    n = len(samples)
    assert sum(scored[:-4]) == n
    assert [sum(rank["scored"][:-4]) for rank in ranks] == [n // 2, n - n // 2]
    for rank in ranks:
        torch.testing.assert_close(rank["prox"], samples.prox_logprob, rtol=1e-6, atol=1e-6)
        if name == "grpo":
            torch.testing.assert_close(rank["ref"], samples.ref_logprob, rtol=1e-6, atol=1e-6)
    minibatches = scored[-4:]
    halves = [[m // 2 for m in minibatches], [m - m // 2 for m in minibatches]]
    assert [rank["scored"][-4:] for rank in ranks] == halves
    moved = False
    for key, value in policy.state_dict().items():
        for rank in ranks:
            torch.testing.assert_close(rank["state"][key], value, rtol=1e-5, atol=1e-6)
        moved = moved or not torch.equal(value, start[key])
    assert moved
    for key, value in alone.items():
        for rank in ranks:
            assert sorted(rank["metrics"]) == sorted(alone)
            assert rank["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("n, sizes", [(7, [2, 2, 2, 1]), (15, [4, 4, 4, 3]), (30, [8, 8, 7, 7])])
def test_num_minibatches_is_the_number_of_minibatches_and_every_sample_is_in_one(n, sizes):
    # (it was n // 4 rows each: 7 minibatches of 1 for 7 samples, 2 of 30 left out an epoch)
    policy, algorithm, samples = samples_for("ppo")
    assert len(samples) >= 30
    engine = TorchEngine(policy, learning_rate=1e-3, max_grad_norm=0.5)
    scored = count_rows(engine)
    rows = torch.arange(n)
    metrics = update(engine, algorithm, samples.index(rows, rows), epochs=1, num_minibatches=4)
    assert scored == sizes and metrics["policy/epochs"] == 1
