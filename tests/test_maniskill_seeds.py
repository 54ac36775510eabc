"""Per-environment seeds on the ManiSkill core (cpu backend, in this process): a seeded reset
draws each distinct seed once and copies that state to the other environments with the seed
(ManiSkillCore.reset). Every row must equal the environment reset alone with its seed (the
one-at-a-time reference below), at the reset and through the next steps, in as many ManiSkill
resets as there are distinct seeds. The last test checks the same on physx_cuda (gpu marker)."""

import pytest
import torch
from physx_gpu import needs_physx_gpu

from embodied.schema import Observation
from embodied.simulators.maniskill.core import SHARED_RESET_TASKS, CoreOptions, ManiSkillCore

B = 5
SEEDS = [7, 9, 7, 7, 9]  # two distinct seeds over five environments
# PhysX reads an articulation's root pose back through its centre of mass: a copied environment's
# robot base sits ~1e-8 m from the drawn one's, which a few steps turn into ~1e-6 in the joints
# (PushT-v1's stick starts against the table: contact makes that ~3e-4 in the first steps)
RESET_ATOL, STEP_ATOL, STEP_PIXELS = 1e-6, {"PushT-v1": 1e-3}, 0

# (task, obs_mode, control_mode): every task that shares resets, images on one, controllers
# that keep drive targets (state beyond the physics) on two, and a task that resets one by one
# The default run keeps one case of each kind (a goal actor, images, drive targets, no copy):
# PushCube's state, PickCube's images, PickCubeSO100's drive targets and RollBall; the other
# shared-reset tasks (PickCube's and StackCube's state: 60-80 s of set-up) run with the slow tests.
DEFAULT = {"PushCube-v1", "RollBall-v1"}
CASES = [
    pytest.param(
        (task, "state", "pd_joint_delta_pos"),
        marks=() if task in DEFAULT else pytest.mark.slow,
        id=f"{task}-state-pd_joint_delta_pos",
    )
    for task in SHARED_RESET_TASKS
] + [
    pytest.param(case, id="-".join(case), marks=marks)
    for case, marks in (
        (("PickCube-v1", "rgb", "pd_joint_delta_pos"), ()),
        # (drive targets: PickCubeSO100's case keeps them in the default run)
        (("StackCube-v1", "state", "pd_joint_target_delta_pos"), pytest.mark.slow),
        (("PickCubeSO100-v1", "state", "pd_joint_target_delta_pos"), ()),
        (("RollBall-v1", "state", "pd_joint_delta_pos"), ()),
    )
]


def _core(task: str, obs_mode: str, control_mode: str) -> ManiSkillCore:
    return ManiSkillCore(
        CoreOptions(
            task=task,
            num_envs=B,
            obs_mode=obs_mode,
            control_mode=control_mode,
            sim_backend="physx_cpu",
            image_size=32,
            render_size=32,
        )
    )


@pytest.fixture(scope="module", params=CASES)
def cores(request):
    """(core under test, reference core): the same task, stepped and reset by each test."""
    new, ref = _core(*request.param), _core(*request.param)
    yield new, ref
    new.close()
    ref.close()


def _reference_reset(core: ManiSkillCore, ids: list[int], seeds: list[int]) -> Observation:
    """The old path: each environment reset alone with its seed, one ManiSkill reset each."""
    for i, s in zip(ids, seeds):
        raw, _ = core.env.reset(seed=s, options={"env_idx": torch.tensor([i])})
    core.elapsed[ids] = 0
    core._elapsed_host[ids] = 0
    core._seeded = True  # (seeded by its caller: its next unseeded reset follows these seeds)
    return core.observation(raw)


def _count_resets(core: ManiSkillCore, monkeypatch) -> list:
    """Record every ManiSkill reset of the core's environments (one entry per call)."""
    calls = []
    for e in core.env.envs:

        def counted(*args, _reset=e.reset, **kwargs):
            calls.append(kwargs.get("seed"))
            return _reset(*args, **kwargs)

        monkeypatch.setattr(e, "reset", counted)
    return calls


def _random_actions(core: ManiSkillCore, gen: torch.Generator) -> torch.Tensor:
    low, high = core.action_spec.bounds()
    shape = (core.opts.num_envs, core.action_spec.dim)
    return low + (high - low) * torch.rand(shape, generator=gen)  # f32 [B, A] on the CPU


def _walk(core: ManiSkillCore, seed: int, steps: int = 3) -> None:
    """Move every environment somewhere else first, so that a reset row has history to lose."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        core.step(_random_actions(core, gen))


def _assert_rows_equal(
    a: Observation, b: Observation, rows_a, rows_b, atol: float, pixels: int = 0
) -> None:
    """Rows ``rows_a`` of ``a`` equal rows ``rows_b`` of ``b``: state and privileged within
    ``atol``, images within ``pixels`` (uint8 levels)."""
    close = dict(rtol=0, atol=atol)
    torch.testing.assert_close(a.state[rows_a], b.state[rows_b], **close)
    assert a.privileged.keys() == b.privileged.keys()
    for k in b.privileged:
        torch.testing.assert_close(a.privileged[k][rows_a], b.privileged[k][rows_b], **close)
    assert a.images.keys() == b.images.keys()
    for k in b.images:
        diff = (a.images[k][rows_a].int() - b.images[k][rows_b].int()).abs()  # int32 [n, H, W, 3]
        assert int(diff.max()) <= pixels, f"images[{k!r}] differ by {int(diff.max())}"


def _assert_same_states(a: ManiSkillCore, b: ManiSkillCore, atol: float) -> None:
    """The full ManiSkill state (bodies, joints, controller targets) of every environment."""
    sa, sb = a.env.get_state_dict(), b.env.get_state_dict()
    torch.testing.assert_close(sa, sb, rtol=0, atol=atol)


def _step_together(new: ManiSkillCore, ref: ManiSkillCore, steps: int = 4) -> None:
    """Identical random actions on both: every output stays identical."""
    atol = STEP_ATOL.get(new.opts.task, 1e-5)
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        a = _random_actions(new, gen)
        x, y = new.step(a), ref.step(a)
        _assert_rows_equal(x[0], y[0], slice(None), slice(None), atol, STEP_PIXELS)
        for u, v in zip(x[1:5], y[1:5]):  # reward, terminated, truncated, success
            torch.testing.assert_close(u, v, rtol=0, atol=atol)
    _assert_same_states(new, ref, atol)


def test_per_env_seeds_reset_each_distinct_seed_once_and_match_lone_resets(cores, monkeypatch):
    new, ref = cores
    _walk(new, seed=1)
    _walk(ref, seed=2)  # a different history: the reset state must not depend on it
    calls = _count_resets(new, monkeypatch)
    obs = new.reset(seed=SEEDS)
    expected = _reference_reset(ref, list(range(B)), SEEDS)
    shared = new.opts.task in SHARED_RESET_TASKS
    assert len(calls) == (len(set(SEEDS)) if shared else B)
    _assert_rows_equal(obs, expected, slice(None), slice(None), RESET_ATOL)
    # equal seeds, equal initial states; different seeds, different ones
    _assert_rows_equal(obs, obs, [0, 0, 1], [2, 3, 4], RESET_ATOL)
    assert not torch.equal(obs.state[0], obs.state[1])
    assert not new.elapsed.any() and not new._elapsed_host.any()
    _assert_same_states(new, ref, RESET_ATOL)
    _step_together(new, ref)


def test_partial_reset_copies_within_the_reset_rows_and_leaves_the_others(cores, monkeypatch):
    new, ref = cores
    new.reset(seed=0)
    ref.reset(seed=0)
    _walk(new, seed=3)
    _walk(ref, seed=3)
    before = new.observation(new.env.get_obs())
    state_before = new.env.get_state_dict()
    elapsed_before = new.elapsed.clone()
    ids, seeds = [4, 3, 2, 0], [9, 7, 9, 7]  # copies go to 2 and 0, in that order; 1 untouched
    calls = _count_resets(new, monkeypatch)
    obs = new.reset(seed=seeds, env_ids=torch.tensor(ids))
    expected = _reference_reset(ref, ids, seeds)
    shared = new.opts.task in SHARED_RESET_TASKS
    assert len(calls) == (2 if shared else len(ids))
    _assert_rows_equal(obs, expected, ids, ids, RESET_ATOL)
    _assert_rows_equal(obs, before, [1], [1], atol=0)
    after = new.env.get_state_dict()
    for group in ("actors", "articulations"):
        for name, x in state_before[group].items():
            torch.testing.assert_close(after[group][name][1], x[1], rtol=0, atol=0)
    assert new.elapsed.tolist() == [0, int(elapsed_before[1]), 0, 0, 0]
    assert new._elapsed_host.tolist() == new.elapsed.tolist()
    _assert_same_states(new, ref, RESET_ATOL)
    _step_together(new, ref)


def test_unseeded_resets_after_a_seeded_one_follow_each_rows_seed(cores):
    """An automatic (unseeded) reset draws its episode from the environment's RNG, which the
    seeded reset set: a copied row carries the RNG of its seed too."""
    new, ref = cores
    new.reset(seed=SEEDS)
    _reference_reset(ref, list(range(B)), SEEDS)
    a, b = new.reset(), ref.reset()
    _assert_rows_equal(a, b, slice(None), slice(None), RESET_ATOL)
    _assert_rows_equal(a, a, [0, 0, 1], [2, 3, 4], RESET_ATOL)
    _assert_same_states(new, ref, RESET_ATOL)


def test_unseeded_resets_before_any_seeded_one_differ_between_workers():
    """Two cores as two worker processes hold them: before any seeded reset, their unseeded
    episodes come from the OS's entropy, so the workers do not repeat one another's."""
    first, second = (_core("PushCube-v1", "state", "pd_joint_delta_pos") for _ in range(2))
    try:
        for _ in range(2):  # the reset at start, then the episodes that follow it
            a, b = first.reset(), second.reset()
            assert not torch.equal(a.privileged["obj_pose"], b.privileged["obj_pose"])
    finally:
        first.close()
        second.close()


def test_a_reset_of_no_rows_as_the_first_gives_the_batch_and_seeds_nothing():
    """A worker none of whose environments a partial reset names gets an empty one: the batch
    as it is, its first episodes still to come from entropy (it died of an UnboundLocalError
    with several environments; with one, it took a seed it reset nothing with)."""
    core = _core("PushCube-v1", "state", "pd_joint_delta_pos")
    try:
        obs = core.reset(seed=5, env_ids=torch.tensor([], dtype=torch.long))
        assert obs.state.shape[0] == B and not core._seeded
    finally:
        core.close()


def test_a_partial_reset_with_an_int_seed_gives_each_row_the_seed_plus_its_id(cores):
    """As ``schema.reset_seeds`` and the cpu workers: row i of ``reset(seed=s, env_ids)``
    starts from s + i (it got s + its position among env_ids). (A full reset with an int on
    physx_cuda keeps ManiSkill's own derivation, design note 36.)"""
    new, ref = cores
    _walk(new, seed=4)
    obs = new.reset(seed=30, env_ids=torch.tensor([3, 1]))
    expected = _reference_reset(ref, [3, 1], [33, 31])
    _assert_rows_equal(obs, expected, [3, 1], [3, 1], RESET_ATOL)


@pytest.mark.gpu
@needs_physx_gpu
@pytest.mark.parametrize(
    "task, control_mode",
    [
        ("PushCube-v1", "pd_joint_delta_pos"),
        ("PickCube-v1", "pd_joint_target_delta_pos"),
        ("PickCubeSO100-v1", "pd_joint_delta_pos"),
    ],
)
def test_gpu_equal_seeds_give_equal_rows_in_one_reset_per_seed(task, control_mode, monkeypatch):
    """physx_cuda: one batched env. The reference resets every environment alone (its slot gets
    ManiSkill's seed list [s] * B, as the shared reset does), one ManiSkill reset each."""
    n = 8
    seeds = [7, 9, 7, 7, 9, 11, 7, 9]  # three distinct seeds
    opts = CoreOptions(task=task, num_envs=n, control_mode=control_mode, sim_backend="physx_cuda")
    new, ref = ManiSkillCore(opts), ManiSkillCore(opts)
    ref._share_resets = False
    try:
        calls = []
        reset = new.env.reset

        def counted(*args, **kwargs):
            calls.append(kwargs.get("seed"))
            return reset(*args, **kwargs)

        monkeypatch.setattr(new.env, "reset", counted)
        gen = torch.Generator().manual_seed(0)
        low, high = new.action_spec.bounds()
        for core in (new, ref):
            for _ in range(3):
                a = low + (high - low) * torch.rand(n, new.action_spec.dim, generator=gen)
                core.step(a.to(core.device))
        obs, expected = new.reset(seed=seeds), ref.reset(seed=seeds)
        assert len(calls) == 3
        _assert_rows_equal(obs, expected, slice(None), slice(None), RESET_ATOL)
        # every slot gets the same episode from the same seed
        _assert_rows_equal(obs, obs, [0, 0, 0, 1, 1], [2, 3, 6, 4, 7], RESET_ATOL)
        assert not torch.equal(obs.state[0], obs.state[1])
        assert not new.elapsed.any() and not new._elapsed_host.any()
        # a partial reset, copies to environments out of order, one environment untouched
        calls.clear()
        before = new.observation(new.env.get_obs())
        ids, part = [6, 3, 2, 0, 4, 7, 1], [9, 7, 9, 7, 11, 11, 9]
        obs = new.reset(seed=part, env_ids=torch.tensor(ids, device=new.device))
        expected = ref.reset(seed=part, env_ids=torch.tensor(ids, device=ref.device))
        assert len(calls) == 3
        _assert_rows_equal(obs, expected, ids, ids, RESET_ATOL)
        _assert_rows_equal(obs, before, [5], [5], RESET_ATOL)
        _assert_rows_equal(obs, obs, [6, 6, 3, 4], [2, 1, 0, 7], RESET_ATOL)
        _assert_same_states(new, ref, RESET_ATOL)
        _step_together(new, ref)
    finally:
        new.close()
        ref.close()
