"""``MuJoCoEnv``: a VecEnv over the MuJoCo desktop arm tasks (simulators/mujoco/tasks.py).

All B environments share one compiled model; their physics states are rows of one array and a
step advances every row at once with ``mujoco.rollout`` (C++, no Python loop over environments).
Observations are read from MuJoCo sensors (joint positions, tool point, task objects); the
sensors of a step are those MuJoCo computes during its last physics substep, i.e. 5 ms before the
step ends. Joint velocities are what a real arm's driver gives: the change of the joint positions
over the control step, times the control rate (LeRobot reads positions only). Cameras render
offscreen through EGL (``MUJOCO_GL``), one environment at a time.

Actions are joint-position deltas (radians per control step) added to each servo's target.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede `import mujoco`

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mujoco import rollout  # noqa: E402

from embodied.schema import Observation, StepOutput, refuse_non_finite  # noqa: E402
from embodied.simulators.mujoco.arm import JOINTS  # noqa: E402
from embodied.simulators.mujoco.config import MuJoCoConfig  # noqa: E402
from embodied.simulators.mujoco.randomize import nominal  # noqa: E402
from embodied.simulators.mujoco.streams import Streams  # noqa: E402
from embodied.simulators.mujoco.tasks import TASKS  # noqa: E402
from embodied.simulators.mujoco.worlds import (  # noqa: E402
    CONTROL_HZ,
    HIGH,
    LOW,
    MAX_DELTA,
    Randomized,
    build_model,
    check_action_shape,
    draw_initial,
    make_spec,
    reseed,
    substeps,
)


class MuJoCoEnv:
    def __init__(self, cfg: MuJoCoConfig):
        cfg.validate()
        self.cfg = cfg
        self.task = TASKS[cfg.task]
        self.num_envs = cfg.num_envs
        self.device = torch.device("cpu")
        self.model = build_model(cfg, self.task)
        self._data = mujoco.MjData(self.model)  # scratch: resets, rendering
        self._rollout_data = [mujoco.MjData(self.model)]
        self._spec_state = mujoco.mjtState.mjSTATE_FULLPHYSICS
        self._control_spec = mujoco.mjtState.mjSTATE_CTRL | mujoco.mjtState.mjSTATE_MOCAP_POS
        self._substeps = substeps(self.model)
        nstate = mujoco.mj_stateSize(self.model, self._spec_state)
        B = self.num_envs
        self._state = np.zeros((B, nstate))  # f64 [B, nstate]: each environment's physics
        self._target = np.zeros((B, self.model.nu))  # f64 [B, 6]: servo targets
        self._mocap = np.zeros((B, 3 * self.model.nmocap))  # f64 [B, 3]: the goal marker
        self._sensors = np.zeros((B, self.model.nsensordata))
        self._elapsed = np.zeros(B, dtype=np.int64)
        self._streams = Streams(B, self.device)
        # domain randomisation: each world a model of its own (mujoco.rollout takes one a world)
        self._randomized = Randomized.of(self.model)
        self.world_params = nominal(B, self.device)  # each world's draw for its episode
        active = cfg.randomize.active
        self._models = [copy.deepcopy(self.model) for _ in range(B)] if active else None
        # f64 [D + 1, B, 6]: the servo targets of the last steps; a world's delay picks its row
        self._history = np.zeros((cfg.randomize.action_delay + 1, B, self.model.nu))
        self._slices = {
            self.model.sensor(i).name: slice(
                self.model.sensor_adr[i], self.model.sensor_adr[i] + self.model.sensor_dim[i]
            )
            for i in range(self.model.nsensor)
        }
        self._joint_qpos = [self.model.jnt_qposadr[self.model.joint(j).id] for j in JOINTS]
        self._pos_cols = np.array([self._slices[f"{j}.pos"].start for j in JOINTS])
        self._previous = np.zeros((B, len(JOINTS)))  # f64 [B, 6]: joints at the step's start
        self._renderers: dict[int, mujoco.Renderer] = {}
        self._low = np.array(LOW)
        self._high = np.array(HIGH)
        self.spec = make_spec(cfg, self.task)

    # --- observations -------------------------------------------------------------------------
    def _read(self, name: str) -> np.ndarray:
        return self._sensors[:, self._slices[name]]

    def _obs(self) -> Observation:
        joints = self._sensors[:, self._pos_cols]  # f64 [B, 6]
        velocity = (joints - self._previous) * CONTROL_HZ  # f64 [B, 6]: as an arm measures it
        state = np.concatenate([joints, velocity], 1)  # f64 [B, 12]
        priv = {k: torch.from_numpy(self._read(k).astype(np.float32)) for k in self._priv_names}
        images = {
            c.name: self._render_all(self.cfg.image_size, c.name) for c in self.spec.obs.cameras
        }
        return Observation(
            state=torch.from_numpy(state.astype(np.float32)),
            instruction=[self.task.instruction] * self.num_envs,
            images=images,
            privileged=priv,
        )

    @property
    def _priv_names(self) -> tuple[str, ...]:
        return tuple(self.spec.obs.privileged)

    def _reward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The task's reward and success (one torch implementation for both backends)."""
        names = self._priv_names + self.task.reads
        readings = {k: torch.from_numpy(self._read(k).astype(np.float32)) for k in names}
        return self.task.evaluate(readings)

    # --- reset / step -------------------------------------------------------------------------
    def _reset_rows(self, ids: Sequence[int]) -> None:
        """Start new episodes in worlds ``ids`` from their streams (simulators/mujoco/worlds.py)."""
        d = self._data
        rows = torch.tensor(ids, dtype=torch.int64)
        cfg = self.cfg
        init = draw_initial(self._streams, self.task, rows, cfg.home_noise, cfg.randomize)
        self.world_params.put(rows, init.params)
        joints = init.joints.double().numpy()  # f64 [N, 6]: exactly the f32 draws
        goal = init.goal.double().numpy()
        cube = None if init.cube is None else init.cube.double().numpy()
        quat = None if init.cube_quat is None else init.cube_quat.double().numpy()
        for row, i in enumerate(ids):
            m = self.model if self._models is None else self._models[i]
            if self._models is not None:
                self._randomized.apply(m, init.params, row)
            mujoco.mj_resetData(m, d)
            d.qpos[self._joint_qpos] = joints[row]
            if cube is not None:
                adr = m.jnt_qposadr[m.body("cube").jntadr[0]]
                d.qpos[adr : adr + 3] = cube[row]  # position
                d.qpos[adr + 3 : adr + 7] = quat[row]  # (w, x, y, z): turned about z
            d.mocap_pos[0] = goal[row]
            d.ctrl[:] = joints[row]
            mujoco.mj_forward(m, d)
            mujoco.mj_getState(m, d, self._state[i], self._spec_state)
            self._target[i] = joints[row]
            self._history[:, i] = joints[row]
            self._mocap[i] = d.mocap_pos.reshape(-1)
            self._sensors[i] = d.sensordata
            self._previous[i] = joints[row]  # at rest: zero velocity
            self._elapsed[i] = 0

    def reset(
        self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None
    ) -> Observation:
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids]
        reseed(self._streams, seed, ids)
        self._reset_rows(ids)
        return self._obs()

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: f32 [B, 6] joint-position deltas in radians, within +-MAX_DELTA; a non-finite
        one is a UserError (it would hold the servo target at NaN until the episode ends)."""
        check_action_shape(f"MuJoCo {self.task.name}", actions, self.num_envs)
        a = actions.detach().cpu().numpy().astype(np.float64)  # f64 [B, 6]
        refuse_non_finite(f"MuJoCo {self.task.name}", a, range(self.num_envs))
        a = np.clip(a, -MAX_DELTA, MAX_DELTA)
        self._target = np.clip(self._target + a, self._low, self._high)
        self._previous = self._sensors[:, self._pos_cols]  # f64 [B, 6] (a gather: a copy)
        states, sensors = self._roll(self._delayed())
        self._state = states[:, -1].copy()  # f64 [B, nstate]
        self._sensors = sensors[:, -1].copy()  # f64 [B, nsensordata]
        self._elapsed += 1
        reward, success = self._reward()
        terminated = success & (not self.cfg.ignore_terminations)
        truncated = torch.from_numpy(self._elapsed >= self.spec.max_episode_steps)
        done = terminated | truncated
        final = None
        if done.any():
            final = self._obs()
            self._reset_rows(torch.nonzero(done)[:, 0].tolist())
        obs = self._obs()
        if final is not None:
            final = final.where(done, obs)  # ended rows: the last observation
        return StepOutput(
            obs=obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            success=success,
            final_obs=final,
            ended=torch.nonzero(done)[:, 0] if final is not None else None,
        )

    def simulate(self, targets: torch.Tensor) -> None:
        """The simulator alone: servo targets (f32 [B, 6], radians) held for one control step of
        physics through ``mujoco.rollout``; no observation, reward or reset (raw throughput)."""
        self._target = targets.double().numpy()  # f64 [B, 6]: held from now on
        states, _ = self._roll(self._target)
        self._state = states[:, -1].copy()

    def _delayed(self) -> np.ndarray:
        """f64 [B, 6]: the servo targets to hold, each world's of its ``delay`` steps ago (with
        no command delay configured, the targets themselves: no history is kept)."""
        if len(self._history) == 1:
            return self._target
        self._history = np.roll(self._history, 1, axis=0)
        self._history[0] = self._target
        delay = self.world_params.delay.numpy()  # int64 [B]
        return self._history[delay, np.arange(self.num_envs)]

    def _roll(self, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One control step of physics with ``targets`` (f64 [B, 6]) held for every substep:
        (states f64 [B, nstep, nstate], sensors f64 [B, nstep, nsensordata])."""
        control = np.concatenate([targets, self._mocap], 1)[:, None]  # f64 [B, 1, nu + 3]
        return rollout.rollout(
            self._models or self.model,
            self._rollout_data,
            self._state,
            control,
            control_spec=self._control_spec,
            nstep=self._substeps,
        )

    # --- rendering ----------------------------------------------------------------------------
    def _render_all(
        self, size: int, camera: str = "base_camera", env_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """uint8 [B or N, size, size, 3]: every environment's view, or only ``env_ids``'."""
        if size not in self._renderers:
            self._renderers[size] = mujoco.Renderer(self.model, size, size)
        r = self._renderers[size]
        d = self._data
        ids = range(self.num_envs) if env_ids is None else [int(i) for i in env_ids.tolist()]
        frames = np.empty((len(ids), size, size, 3), dtype=np.uint8)  # uint8 [N, H, W, 3]
        for row, i in enumerate(ids):  # one GL context renders each environment's state in turn
            if self._models is not None:  # the world's cube, camera and light
                self._randomized.apply(self.model, self.world_params, i)
            mujoco.mj_setState(self.model, d, self._state[i], self._spec_state)
            d.mocap_pos[:] = self._mocap[i].reshape(-1, 3)
            mujoco.mj_forward(self.model, d)
            r.update_scene(d, camera=camera)
            frames[row] = r.render()
        if self._models is not None:
            self._randomized.apply(self.model, nominal(1, self.device), 0)  # as written again
        return torch.from_numpy(frames)

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self._render_all(self.cfg.render_size, env_ids=env_ids)

    def close(self) -> None:
        for r in self._renderers.values():
            r.close()
        self._renderers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
