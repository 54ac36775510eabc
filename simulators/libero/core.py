"""``LiberoCore``: n LIBERO environments of one task in this process, speaking the packed numpy
protocol of ``embodied.simulators.workers`` (a worker subprocess holds one core).

Observations: the agent-view and wrist cameras (rotated 180 degrees, as the LeRobot and OpenVLA
LIBERO datasets store them: robosuite renders bottom row first), proprioception (joint positions,
end-effector position and quaternion, gripper fingers), the task's language instruction, and the
objects' poses as privileged state. Actions are end-effector goal offsets in metres and radians
(robosuite's delta mode: each step the operational-space controller chases a goal that far from the
current pose, and covers ~25% of it within the step) plus a gripper command in [-1 open, +1 close];
the controller receives them divided by its output scale (0.05 m, 0.5 rad). Success is the task's
BDDL goal predicates (LIBERO's own check).
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede robosuite's import

import numpy as np  # noqa: E402

from embodied.schema import (  # noqa: E402
    ActionSpec,
    CameraSpec,
    EnvSpec,
    ObsSpec,
    refuse_non_finite,
)
from embodied.simulators.libero.config import LiberoConfig  # noqa: E402
from embodied.simulators.libero.paths import prepare  # noqa: E402

CAMERAS = {
    "agentview": "agentview_image",
    "wrist": "robot0_eye_in_hand_image",
}  # ours -> robosuite's key
STATE_NAMES = (
    tuple(f"joint_{i}.pos" for i in range(1, 8))
    + ("eef.x", "eef.y", "eef.z", "eef.qx", "eef.qy", "eef.qz", "eef.qw")
    + ("finger_left.pos", "finger_right.pos")
)
OPEN_GRIPPER = -1.0


def load_task(suite: str, task_id: int):
    """(LIBERO task, its BDDL file path, its fixed initial states f64 [50, D])."""
    assets = prepare()
    import libero.libero as libero_root
    from libero.libero import benchmark, get_libero_path

    # hf-libero looks for assets next to its code, else downloads them; point it at the package
    libero_root._assets_path_cache = str(assets)
    bench = benchmark.get_benchmark_dict()[suite]()
    task = bench.get_task(task_id)
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    return task, bddl, bench.get_task_init_states(task_id)


class LiberoCore:
    def __init__(self, cfg: LiberoConfig, num_envs: int):
        cfg.validate()
        self.cfg = cfg
        self.num_envs = num_envs
        # first: LIBERO's config, then its import
        task, bddl, self.init_states = load_task(cfg.suite, cfg.task_id)
        from libero.libero.envs import OffScreenRenderEnv

        # ignore_done: episodes end here (time limit, success); hard_reset off: the model is built
        # once and every reset loads a full initial state (_start clears what a rebuild would),
        # ~1 s less per reset
        cameras = cfg.obs_mode == "rgb"
        self.envs = [
            OffScreenRenderEnv(
                bddl_file_name=bddl,
                camera_heights=cfg.image_size,
                camera_widths=cfg.image_size,
                use_camera_obs=cameras,
                has_offscreen_renderer=cameras,
                ignore_done=True,
                hard_reset=False,
            )
            for _ in range(num_envs)
        ]
        self._cameras = CAMERAS if cameras else {}
        controller = self.envs[0].robots[0].controller
        # f32 [6]: physical = normalized * scale
        self._scale = np.asarray(controller.output_max, dtype=np.float32)
        self.instruction = task.language
        self.spec = self._make_spec()
        self._low = np.asarray(self.spec.action.low, dtype=np.float32)
        self._high = np.asarray(self.spec.action.high, dtype=np.float32)
        self._raw: list[dict] = [None] * num_envs  # each environment's latest robosuite observation
        self._rngs: list[np.random.Generator] = [None] * num_envs  # seeds of unseeded resets
        self._elapsed = np.zeros(num_envs, dtype=np.int64)
        # every environment holds an episode from the start (render, subset resets); an
        # unseeded reset before any seeded one draws its seed from the OS's entropy, each
        # environment its own (as MuJoCo's worlds do): from a fixed seed every environment of
        # every worker would repeat one sequence of episodes
        for i in range(num_envs):
            self._start(i, 0)
            self._rngs[i] = np.random.default_rng()

    def _make_spec(self) -> EnvSpec:
        n_obj = int(self.envs[0].env._get_observations()["object-state"].shape[0])
        hw = self.cfg.image_size
        return EnvSpec(
            obs=ObsSpec(
                cameras=tuple(CameraSpec(c, hw, hw) for c in self._cameras),
                state_names=STATE_NAMES,
                privileged={"object_state": (n_obj,)},
            ),
            action=ActionSpec(
                "ee_delta_pose",
                ("dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"),
                tuple((-self._scale).tolist()) + (-1.0,),
                tuple(self._scale.tolist()) + (1.0,),
                gripper=6,
                control_hz=float(self.envs[0].env.control_freq),
                deltas_from="measured",  # (the goal is an offset from the pose as it is)
            ),
            max_episode_steps=self.cfg.episode_steps,
            instructions=(self.instruction,),
        )

    # --- observations -----------------------------------------------------------------------
    def _pack(self, ids) -> dict:
        raws = [self._raw[i] for i in ids]
        state = np.stack(
            [
                np.concatenate(
                    [
                        r["robot0_joint_pos"],
                        r["robot0_eef_pos"],
                        r["robot0_eef_quat"],
                        r["robot0_gripper_qpos"],
                    ]
                )
                for r in raws
            ]
        ).astype(np.float32)  # f32 [n, 16]
        images = {
            c: np.stack([r[key][::-1, ::-1] for r in raws]) for c, key in self._cameras.items()
        }  # uint8 [n, H, W, 3]
        priv = {
            "object_state": np.stack([r["object-state"] for r in raws]).astype(np.float32)
        }  # f32 [n, D]
        return {
            "state": state,
            "images": images,
            "privileged": priv,
            "instruction": [self.instruction] * len(raws),
        }

    # --- episodes -----------------------------------------------------------------------------
    def _start(self, i: int, seed: int) -> None:
        """Episode of environment i from initial state ``seed % 50``; the seed also fixes LIBERO's
        own reset randomness (fixture placement, which the initial states do not hold)."""
        env = self.envs[i]
        env.seed(seed)
        env.reset()
        raw = env.set_init_state(self.init_states[seed % len(self.init_states)])
        # not in the state either: the solver's warm start and the gripper's rate-limited command
        # (a rebuilt model, robosuite's hard reset, starts both at zero; we keep the model and zero
        # them)
        env.sim.data.qacc_warmstart[:] = 0
        gripper = env.robots[0].gripper
        gripper.current_action = np.zeros_like(gripper.current_action)
        settle = np.zeros(7, dtype=np.float64)
        settle[6] = OPEN_GRIPPER
        for _ in range(self.cfg.settle_steps):
            raw, _, _, _ = env.step(settle)
        self._raw[i] = raw
        self._elapsed[i] = 0
        self._rngs[i] = np.random.default_rng(seed)

    def _next_seed(self, i: int) -> int:
        return int(self._rngs[i].integers(2**31))

    def reset(self, ids: list[int], seeds: list[int | None]) -> dict:
        """Reset environments ``ids``; seed s -> initial state s % 50 (None: a seed drawn from the
        environment's previous one, or from entropy before any). Returns every environment's
        observation."""
        for i, s in zip(ids, seeds):
            self._start(i, self._next_seed(i) if s is None else int(s))
        return self._pack(range(self.num_envs))

    def step(self, ids: list[int], actions: np.ndarray):
        """actions: f32 [n, 7] physical units for environments ``ids`` -> (obs of ids, f32 [n, 4]
        reward/terminated/truncated/success, final obs of ids or None)."""
        # (one NaN held robosuite's gripper at NaN until the next reset)
        refuse_non_finite(f"LIBERO {self.cfg.suite}/{self.cfg.task_id}", actions, ids)
        actions = np.clip(actions, self._low, self._high)
        scalars = np.zeros((len(ids), 4), dtype=np.float32)
        for row, i in enumerate(ids):
            command = actions[row].astype(np.float64)
            command[:6] /= self._scale
            raw, reward, success, _ = self.envs[i].step(command)  # LIBERO's done is its goal check
            self._raw[i] = raw
            self._elapsed[i] += 1
            terminated = bool(success) and not self.cfg.ignore_terminations
            truncated = not terminated and self._elapsed[i] >= self.cfg.episode_steps
            scalars[row] = (reward, terminated, truncated, success)
        ended = [row for row in range(len(ids)) if scalars[row, 1] or scalars[row, 2]]
        final = None
        if ended:
            final = self._pack(ids)
            for row in ended:
                self._start(ids[row], self._next_seed(ids[row]))
        return self._pack(ids), scalars, final

    def render(self, ids: list[int] | None = None) -> np.ndarray:
        """uint8 [n or len(ids), H, W, 3]: the agent-view frames of the latest observations of
        every environment or of ``ids`` (local indices; rendered here when the observations have
        no cameras)."""
        ids = range(len(self.envs)) if ids is None else ids
        if self._cameras:
            return np.stack([self._raw[i][CAMERAS["agentview"]][::-1, ::-1] for i in ids])
        size = self.cfg.image_size
        sims = [self.envs[i].sim for i in ids]
        frames = [s.render(camera_name="agentview", width=size, height=size) for s in sims]
        return np.ascontiguousarray(np.stack(frames)[:, ::-1, ::-1])  # uint8 [N, H, W, 3], upright

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []
