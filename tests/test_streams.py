"""Random streams per worker (embodied/streams.py): derivation, isolation, saving, resuming."""

import torch

from embodied.inference import InferencePolicy
from embodied.streams import Stream, resumed, saved_streams, stream_seed


def test_the_derivation_is_fixed_and_separates_seed_role_rank_and_restart():
    # golden values: changing the derivation changes every run's draws (and its baseline)
    assert stream_seed(0, "actor", 0) == 8514611595815388268
    assert stream_seed(0, "rollout", 1) == 4212391749167696410
    seeds = {
        stream_seed(seed, role, rank, start)
        for seed in (0, 1)
        for role in ("actor", "rollout")
        for rank in (0, 1, 2)
        for start in (0, 7)
    }
    assert len(seeds) == 24
    assert all(0 <= s < 2**63 for s in seeds)


def test_draws_inside_a_stream_are_its_own_and_leave_the_process_generator_alone():
    torch.manual_seed(123)
    expected_outside = torch.rand(6)
    stream = Stream.derived(0, "rollout", 0)
    own = torch.Generator().manual_seed(stream.seed)
    expected_inside = torch.rand(4, generator=own)

    torch.manual_seed(123)
    outside = [torch.rand(3)]
    with stream.drawing():
        inside = torch.rand(4)
    outside.append(torch.rand(3))
    assert torch.equal(inside, expected_inside)
    assert torch.equal(torch.cat(outside), expected_outside)  # as if nothing had drawn


def test_interleaved_streams_draw_what_each_draws_alone():
    actor, rollout = Stream.derived(3, "actor", 0), Stream.derived(3, "rollout", 0)
    alone = {}
    for key, seed in ((actor.key, actor.seed), (rollout.key, rollout.seed)):
        alone[key] = torch.rand(8, generator=torch.Generator().manual_seed(seed))
    drawn = {actor.key: [], rollout.key: []}
    for _ in range(4):  # act, update, act, update ... in one process
        for stream in (rollout, actor):
            with stream.drawing():
                drawn[stream.key].append(torch.rand(2))
    for key in drawn:
        assert torch.equal(torch.cat(drawn[key]), alone[key])


def test_a_saved_state_continues_the_stream_where_it_was():
    stream = Stream.derived(0, "actor", 0)
    with stream.drawing():
        torch.rand(5)
    saved = stream.state()
    with stream.drawing():
        expected = torch.rand(5)
    restarted = Stream.derived(0, "actor", 0)  # (a restarted worker's fresh stream)
    restarted.load(saved)
    with restarted.drawing():
        assert torch.equal(torch.rand(5), expected)


def test_a_resume_takes_the_saved_stream_or_restarts_it_at_the_iteration():
    stream = Stream.derived(0, "rollout", 1)
    with stream.drawing():
        torch.rand(3)
    rng = {"streams": {stream.key: stream.state()}}
    with stream.drawing():
        expected = torch.rand(3)

    again = Stream.derived(0, "rollout", 1)
    resumed(again, rng, seed=0, iteration=4)
    with again.drawing():
        assert torch.equal(torch.rand(3), expected)

    old_format = {"torch": torch.get_rng_state(), "numpy": None, "python": None, "cuda": None}
    assert saved_streams(old_format) is None
    restarted = Stream.derived(0, "rollout", 1)
    resumed(restarted, old_format, seed=0, iteration=4)
    assert restarted.seed == stream_seed(0, "rollout", 1, start=4)
    other_rank = Stream.derived(0, "rollout", 2)  # (a worker the checkpoint's run lacked)
    resumed(other_rank, rng, seed=0, iteration=4)
    assert other_rank.seed == stream_seed(0, "rollout", 2, start=4)


class Sampler(torch.nn.Module):
    """Draws one number per row when sampling, none when deterministic."""

    has_critic = False

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def act(self, obs, *, deterministic=False):
        from embodied.schema import PolicyOutput

        B = obs.batch_size
        noise = torch.zeros(B, 1, 1) if deterministic else torch.randn(B, 1, 1)
        return PolicyOutput(actions=noise, logprob=torch.zeros(B), value=None)


def test_inference_samples_from_its_stream_and_deterministic_acts_draw_nothing():
    from embodied.schema import Observation

    obs = Observation(state=torch.zeros(4, 2), instruction=[""] * 4)
    stream = Stream.derived(0, "rollout", 0)
    inference = InferencePolicy(Sampler(), stream=stream)
    expected = torch.randn(2, 4, generator=torch.Generator().manual_seed(stream.seed))
    first = inference.act(obs).actions.flatten()
    inference.act(obs, deterministic=True)  # (an evaluation between two rounds)
    second = inference.act(obs).actions.flatten()
    assert torch.equal(torch.stack([first, second]), expected)
