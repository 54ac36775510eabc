"""Domain randomisation per world on both MuJoCo backends: drawn from each world's stream (seeded,
equal on both backends), each range doing what it says in the physics, and kept with recorded
episodes."""

import copy
from dataclasses import replace

import mujoco
import numpy as np
import pytest
import torch
from one_line import one_line_error, run_cli

from embodied.simulators.mujoco import MuJoCoConfig, make_env
from embodied.simulators.mujoco.randomize import NUM_DRAWS, RandomizeConfig, draw
from embodied.simulators.mujoco.tasks import CUBE_HALF, LIFT, TASKS

BACKENDS = ["rollout", "warp"]
WIDE = RandomizeConfig(
    cube_size=0.2,
    cube_yaw=0.5,
    friction=0.3,
    mass=0.3,
    servo_gain=0.3,
    action_delay=2,
    camera_pos=0.02,
    light_pos=0.1,
    light=0.3,
)


def _env(backend: str, task: str, randomize: RandomizeConfig, n: int = 8, **cfg):
    if backend == "warp":
        pytest.importorskip("mujoco_warp")
    cfg = MuJoCoConfig(task=task, num_envs=n, backend=backend, randomize=randomize, **cfg)
    return make_env(cfg)


def test_uniforms_become_the_ranges_golden():
    u = torch.zeros(3, NUM_DRAWS)
    u[1] = 0.5
    u[2] = 0.999
    p = draw(WIDE, u)
    torch.testing.assert_close(p.cube_scale, torch.tensor([0.8, 1.0, 1.1996]), atol=1e-4, rtol=0)
    torch.testing.assert_close(p.cube_yaw, torch.tensor([-0.5, 0.0, 0.499]), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        p.gain_scale[:, 0], torch.tensor([0.7, 1.0, 1.2994]), atol=1e-4, rtol=0
    )
    assert p.delay.tolist() == [0, 1, 2]  # 0 .. action_delay, each a third of [0, 1)
    torch.testing.assert_close(p.camera_offset[0], torch.full((3,), -0.02))
    off = draw(RandomizeConfig(), torch.rand(4, NUM_DRAWS))  # ranges of 0: the model as written
    assert torch.equal(off.cube_scale, torch.ones(4)) and torch.equal(
        off.delay, torch.zeros(4).long()
    )
    assert torch.equal(off.gain_scale, torch.ones(4, 6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_turning_randomisation_on_changes_no_initial_place(backend):
    ranges = WIDE if backend == "rollout" else replace(WIDE, light=0.0)  # (warp: no brightness)
    rgb = {"obs_mode": "rgb", "image_size": 16}  # (the camera's and light's ranges act on images)
    plain = _env(backend, "push", RandomizeConfig(), **rgb)
    with plain, _env(backend, "push", ranges, **rgb) as wide:
        a = plain.reset(seed=list(range(8))).privileged
        b = wide.reset(seed=list(range(8))).privileged
        torch.testing.assert_close(a["goal_pos"], b["goal_pos"])
        torch.testing.assert_close(a["cube_pos"][:, :2], b["cube_pos"][:, :2])
        # resting on the table at its own half-size
        expected = CUBE_HALF * wide.world_params.cube_scale
        torch.testing.assert_close(b["cube_pos"][:, 2], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resized_cube_rests_at_its_size_in_the_physics(backend):
    with _env(backend, "push", RandomizeConfig(cube_size=0.3)) as env:
        env.reset(seed=list(range(8)))
        for _ in range(5):  # the cube settles on the table: its collision box has that size
            obs = env.step(torch.zeros(8, 6)).obs
        half = CUBE_HALF * env.world_params.cube_scale
        assert (half.max() - half.min()) > 0.004  # 4 mm apart at least
        torch.testing.assert_close(obs.privileged["cube_pos"][:, 2], half, atol=5e-4, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pick_pays_no_lift_to_a_large_cube_at_rest(backend):
    """The goal marks LIFT over where each world's cube rests; a cube at rest earns no lift
    reward, however large (a 1.3x cube rests 4.5 mm higher: 0.045 of reward when the lift was
    measured from the cube as written)."""
    with _env(backend, "pick", RandomizeConfig(cube_size=0.3), n=4) as env:
        env.reset(seed=[5, 7, 9, 20])  # cubes of 1.17, 1.25, 0.72 and 1.20 times the size
        out = env.step(torch.zeros(4, 6))  # the arm stays at home, far from the cube
        goal = out.obs.privileged["goal_pos"]
        cube = out.obs.privileged["cube_pos"]
        scale = env.world_params.cube_scale
        assert scale.max() > 1.2
        torch.testing.assert_close(goal[:, 2], CUBE_HALF * scale + LIFT, atol=1e-6, rtol=0)
        torch.testing.assert_close(
            goal[:, 2] - cube[:, 2], torch.full((4,), LIFT), atol=5e-4, rtol=0
        )
        reach = 1.0 - torch.tanh(10.0 * (out.obs.privileged["tcp_pos"] - cube).norm(dim=1))
        torch.testing.assert_close(out.reward, reach / 4.0, atol=2e-3, rtol=0)  # no lift, no grasp
        assert not out.success.any()


def test_pick_succeeds_at_a_lift_over_the_worlds_own_rest():
    rest = CUBE_HALF * torch.tensor([0.7, 1.0, 1.3])  # f32 [3]: three cubes' centres at rest
    far = torch.tensor([0.0, 0.0, 0.3]).expand(3, 3)
    readings = {"tcp_pos": far, "gripper.pos": torch.ones(3, 1)}
    readings["goal_pos"] = torch.stack([torch.full((3,), 0.2), torch.zeros(3), rest + LIFT], 1)
    for lifted, expected in ((LIFT - 1e-3, False), (LIFT + 1e-4, True)):
        readings["cube_pos"] = torch.stack(
            [torch.full((3,), 0.2), torch.zeros(3), rest + lifted], 1
        )
        _, success = TASKS["pick"].evaluate(readings)
        assert success.tolist() == [expected] * 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_delayed_world_takes_its_command_steps_late(backend):
    with _env(backend, "reach", RandomizeConfig(action_delay=2), n=16) as env:
        start = env.reset(seed=list(range(16))).state[:, 0]  # shoulder_pan
        delay = env.world_params.delay
        assert set(delay.tolist()) == {0, 1, 2}
        push = torch.zeros(16, 6)
        push[:, 0] = 0.1
        moved = []
        for _ in range(3):
            moved.append(env.step(push).obs.state[:, 0] - start)
            push = torch.zeros(16, 6)  # one command, then none
        moved = torch.stack(moved)  # f32 [3, 16]: the pan's motion after each step
        for step in range(3):  # a world with delay d moves in step d (0-based), not before
            still = delay > step
            assert torch.all(moved[step][still].abs() < 1e-3)
            assert moved[step][~still].min() > 0.03


def test_both_backends_randomise_alike():
    # free motion under randomised gains and delays agrees to float32 precision across the
    # backends (the same draws, applied the same way), and differs from the model as written
    seeds = list(range(8))
    cfg = RandomizeConfig(servo_gain=0.3, action_delay=2)
    with _env("warp", "reach", cfg) as warp, _env("rollout", "reach", cfg) as rollout:
        with _env("rollout", "reach", RandomizeConfig()) as plain:
            for env in (warp, rollout, plain):
                env.reset(seed=seeds)
            for name in ("gain_scale", "delay"):
                assert torch.equal(
                    getattr(warp.world_params, name), getattr(rollout.world_params, name)
                )
            g = torch.Generator().manual_seed(0)
            gap = 0.0
            apart = 0.0
            for _ in range(30):
                a = torch.rand(8, 6, generator=g) * 0.2 - 0.1
                w, r, p = (env.step(a).obs.state[:, :6] for env in (warp, rollout, plain))
                gap = max(gap, (w - r).abs().max().item())
                apart = max(apart, (r - p).abs().max().item())
    assert gap < 1e-4 and apart > 0.05


def test_both_backends_place_each_worlds_camera_and_light_alike():
    """Each world's camera and light rows (MuJoCo Warp's written by torch on its device) are the
    rollout backend's per-world models' (rgb: a state run may not vary what no image shows)."""
    ranges = RandomizeConfig(camera_pos=0.02, light_pos=0.1)
    rgb = {"obs_mode": "rgb", "image_size": 16}
    warp = _env("warp", "push", ranges, **rgb)
    with warp, _env("rollout", "push", ranges, **rgb) as rollout:
        warp.reset(seed=list(range(8)))
        rollout.reset(seed=list(range(8)))
        camera = rollout.model.camera("base_camera").id
        for field, row in (("cam_pos", camera), ("light_pos", 0)):
            ours = np.stack([getattr(world, field)[row] for world in rollout._models])  # [8, 3]
            on_warp = warp._batched.view[field][:, row].double().cpu().numpy()
            np.testing.assert_allclose(on_warp, ours, atol=1e-6, err_msg=field)
            assert np.abs(ours - getattr(rollout.model, field)[row]).max() > 0.005, field


def test_a_worlds_cube_is_the_solid_cube_mujoco_would_compile_at_its_mass_and_size():
    """The cube's inertia is a solid cube's of the drawn mass and size, and what MuJoCo derives
    from them (mj_setConst: the inverse weights that set its contacts' softness, the subtree
    masses) is each world's own on both backends. They were the 30 g cube's as written: a 0.7x
    cube sliding on the table ended 13 mm from where the compiled one did."""
    pytest.importorskip("mujoco_warp")
    ranges = RandomizeConfig(cube_size=0.3, mass=0.3)
    with _env("rollout", "push", ranges) as rollout, _env("warp", "push", ranges) as warp:
        rollout.reset(seed=list(range(8)))
        warp.reset(seed=list(range(8)))
        nominal = rollout.model  # (the shared model: as written)
        cube = nominal.body("cube").id
        dofs = slice(int(nominal.body_dofadr[cube]), int(nominal.body_dofadr[cube]) + 6)
        params = rollout.world_params
        assert params.mass_scale.min() < 0.85 and params.mass_scale.max() > 1.15
        view = warp._batched.view
        for i, world in enumerate(rollout._models):
            mass, size = float(params.mass_scale[i]), float(params.cube_scale[i])
            expected = nominal.body_inertia[cube] * mass * size**2
            np.testing.assert_allclose(world.body_inertia[cube], expected, rtol=1e-12)
            compiled = copy.deepcopy(world)
            mujoco.mj_setConst(compiled, mujoco.MjData(compiled))
            for name, at in (("body_invweight0", cube), ("dof_invweight0", dofs)):
                ours = getattr(world, name)[at]
                np.testing.assert_allclose(ours, getattr(compiled, name)[at], rtol=1e-9)
                on_warp = view[name][i, at].double().numpy()
                np.testing.assert_allclose(on_warp, ours, rtol=1e-6)
            np.testing.assert_allclose(world.body_subtreemass, compiled.body_subtreemass)
            on_warp = view["body_subtreemass"][i].double().numpy()
            np.testing.assert_allclose(on_warp, world.body_subtreemass, rtol=1e-6)
            assert abs(world.body_invweight0[cube, 0] - nominal.body_invweight0[cube, 0]) > 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_cube_slides_on_the_table_at_its_worlds_friction(backend):
    """A contact takes the larger of its geoms' frictions: the table's scales with the cube's,
    so a world drawn below 1 slides on less friction (it slid on the table's 1.0)."""
    with _env(backend, "push", RandomizeConfig(friction=0.3)) as env:
        env.reset(seed=list(range(8)))
        scale = env.world_params.friction_scale
        assert scale.min() < 0.85
        if backend == "warp":
            table = env.host_model.geom("table").id
            friction = env._batched.view["geom_friction"][:, table, 0]
            torch.testing.assert_close(friction, scale)
            return
        env.step(torch.zeros(8, 6))  # (the cube at rest on the table)
        for i, world in enumerate(env._models):
            data = mujoco.MjData(world)
            mujoco.mj_setState(world, data, env._state[i], env._spec_state)
            mujoco.mj_forward(world, data)
            pair = {world.geom("table").id, int(world.body_geomadr[world.body("cube").id])}
            on_table = [c for c in data.contact[: data.ncon] if {c.geom1, c.geom2} == pair]
            assert on_table
            for contact in on_table:
                assert contact.friction[0] == pytest.approx(float(scale[i]), rel=1e-6)


def _cube_contacts(model: mujoco.MjModel, places: np.ndarray) -> list[list[tuple]]:
    """The cube's contacts (other geom, friction) with the cube at each of ``places``."""
    data = mujoco.MjData(model)
    cube = int(model.body_geomadr[model.body("cube").id])
    at = int(model.jnt_qposadr[model.body_jntadr[model.body("cube").id]])
    found = []
    for place in places:
        data.qpos[at : at + 3] = place
        mujoco.mj_forward(model, data)
        pairs = [(c.geom1, c.geom2, c.friction[0]) for c in data.contact[: data.ncon]]
        found.append([(a + b - cube, f) for a, b, f in pairs if cube in (a, b)])
    return found


def _around_the_jaw(model: mujoco.MjModel, n: int) -> np.ndarray:
    data = mujoco.MjData(model)
    mujoco.mj_forward(model, data)
    jaw = data.geom("fixed_jaw_pad").xpos  # f64 [3]
    return jaw + np.random.default_rng(0).uniform(-0.05, 0.05, (n, 3))


def test_an_enlarged_cube_meets_the_arm_where_mujoco_compiled_at_its_size_would():
    """MuJoCo tests a body's bounding box before its geoms. The cube's stayed the 3 cm box as
    written, so an arm link inside a 1.3x cube's faces touched nothing (189 of 1,414 places)."""
    from embodied.simulators.mujoco.arm import scene
    from embodied.simulators.mujoco.worlds import Randomized

    task, scale = TASKS["pick"], 1.3
    written = f'size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}"'
    assert written in task.bodies
    half = CUBE_HALF * scale
    bodies = task.bodies.replace(written, f'size="{half} {half} {half}"')
    compiled = mujoco.MjModel.from_xml_string(scene(bodies, task.sensors))
    ours = mujoco.MjModel.from_xml_string(scene(task.bodies, task.sensors))
    Randomized.of(ours)._apply_cube(ours, scale, 1.0)
    places = _around_the_jaw(compiled, 600)
    table = compiled.geom("table").id
    touches = [{g for g, _ in c if g != table} for c in _cube_contacts(compiled, places)]
    assert sum(bool(t) for t in touches) > 100  # (the arm's links around the places)
    assert [{g for g, _ in c if g != table} for c in _cube_contacts(ours, places)] == touches


def test_a_world_below_1_has_its_friction_in_every_contact_of_the_cube():
    """A contact takes the larger of its two geoms' frictions: a world drawn at 0.5 had the
    cube slide on the arm's finger boxes at 1.0 (the pads and the table alone scaled)."""
    from embodied.simulators.mujoco.worlds import Randomized, build_model

    model = build_model(MuJoCoConfig(task="pick"), TASKS["pick"])
    nominal = model.geom_friction[:, 0].copy()
    params = draw(RandomizeConfig(friction=0.5), torch.zeros(1, NUM_DRAWS))
    assert float(params.friction_scale[0]) == 0.5
    Randomized.of(model).apply(model, params, 0)
    cube = int(model.body_geomadr[model.body("cube").id])
    seen = set()
    for contacts in _cube_contacts(model, _around_the_jaw(model, 300)):
        for other, friction in contacts:
            assert friction == pytest.approx(0.5 * max(nominal[other], nominal[cube]), rel=1e-9)
            seen.add(model.geom(other).name)
    assert {"fixed_finger", "fixed_jaw_pad"} <= seen, seen


def test_each_world_draw_is_kept_with_its_recorded_episode(tmp_path, capsys):
    import pyarrow.parquet as pq

    from embodied.cli import main

    randomize = ["env.randomize.servo_gain=0.2", "env.randomize.action_delay=1"]
    argv = ["demos", "configs/mujoco/demos_reach.yaml", "episodes=2", "max_attempts=2"]
    argv += ["env.num_envs=2", "env.image_size=16", *randomize, f"output={tmp_path / 'ds'}"]
    assert main(argv) == 0
    capsys.readouterr()
    episodes = tmp_path / "ds" / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(episodes)
    worlds = table.column("world").to_pylist()
    seeds = [int(s) for s in table.column("seed").to_pylist()]
    cfg = MuJoCoConfig(task="reach", num_envs=2, randomize=RandomizeConfig(0, 0, 0, 0, 0.2, 1))
    with make_env(cfg) as env:  # the same seed draws the same world: the episode can be re-run
        env.reset(seed=seeds)
        again = env.world_params.to_dict()
    for i, world in enumerate(worlds):
        assert world["gain_scale"] == pytest.approx(again["gain_scale"][i])
        assert world["delay"] == again["delay"][i]
    assert len({tuple(w["gain_scale"]) for w in worlds}) == 2  # each world its own


@pytest.mark.parametrize(
    "ranges, message",
    [
        ({"friction": -0.1}, "randomize.friction: must be >= 0, got -0.1"),
        ({"mass": 1.0}, "randomize.mass: a relative range below 1, got 1.0"),
    ],
)
def test_a_range_out_of_bounds_is_named_under_randomize(ranges, message):
    """Built in code (a config file's section is named env.randomize.* by the config loader)."""
    with pytest.raises(ValueError, match=message):
        make_env(MuJoCoConfig(task="push", randomize=RandomizeConfig(**ranges)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["env.backend=warp", "env.randomize.light=0.3"],
            "env.randomize.light: the warp backend cannot vary the light's brightness (MuJoCo "
            "Warp's renderer has no per-world light intensity); env.backend=rollout does",
        ),
        (["env.randomize.cube_size=0.2"], "env.randomize.cube_size: the reach task has no cube"),
        (["env.randomize.cube_yaw=0.2"], "env.randomize.cube_yaw: the reach task has no cube"),
        (["env.randomize.mass=0.2"], "env.randomize.mass: the reach task has no cube to vary"),
        (
            ["env.njmax=200"],
            "env.njmax: sizes MuJoCo Warp's buffers (env.backend=warp); the rollout backend "
            "has none",
        ),
        (["env.nconmax=64"], "env.nconmax: sizes MuJoCo Warp's buffers (env.backend=warp)"),
        (
            ["env.randomize.camera_pos=0.02"],
            "env.randomize.camera_pos: varies the images, and obs_mode=state has none",
        ),
    ],
)
def test_a_setting_its_backend_or_task_would_ignore_is_a_one_line_config_error(
    overrides, message, capsys
):
    """Before, each was accepted and did nothing; the light's range was recorded with each
    demonstration's world as if applied, and a state policy's camera range too."""
    rc, err = run_cli(["train", "configs/mujoco/reach_ppo.yaml", *overrides], capsys)
    one_line_error(rc, err, message)
