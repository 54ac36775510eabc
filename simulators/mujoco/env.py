"""``MuJoCoEnv``: a VecEnv over the MuJoCo desktop arm tasks (simulators/mujoco/tasks.py).

All B environments share one compiled model; their physics states are rows of one array and a
step advances every row at once with ``mujoco.rollout`` (C++, no Python loop over environments).
Observations are read from MuJoCo sensors (joint positions and velocities, tool point, task
objects); the sensors of a step are those MuJoCo computes during its last physics substep, i.e.
5 ms before the step ends. Cameras render offscreen through EGL (``MUJOCO_GL``), one environment
at a time.

Actions are joint-position deltas (radians per control step) added to each servo's target.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede `import mujoco`

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from mujoco import rollout  # noqa: E402

from embodied.schema import (
    ActionSpec,
    CameraSpec,
    EnvSpec,
    Observation,
    ObsSpec,
    StepOutput,
    reset_seeds,
)  # noqa: E402
from embodied.simulators.mujoco.arm import HOME, JOINTS, RANGES, scene  # noqa: E402
from embodied.simulators.mujoco.config import MuJoCoConfig  # noqa: E402
from embodied.simulators.mujoco.tasks import TASKS  # noqa: E402

CONTROL_HZ = 20.0
MAX_DELTA = 0.1  # radians per control step (2 rad/s)


class MuJoCoEnv:
    def __init__(self, cfg: MuJoCoConfig):
        cfg.validate()
        self.cfg = cfg
        self.task = TASKS[cfg.task]
        self.num_envs = cfg.num_envs
        self.device = torch.device("cpu")
        self.model = mujoco.MjModel.from_xml_string(scene(self.task.bodies, self.task.sensors))
        self.model.vis.global_.offwidth = self.model.vis.global_.offheight = max(
            cfg.image_size, cfg.render_size
        )
        self._data = mujoco.MjData(self.model)  # scratch: resets, rendering
        self._rollout_data = [mujoco.MjData(self.model)]
        self._spec_state = mujoco.mjtState.mjSTATE_FULLPHYSICS
        self._control_spec = mujoco.mjtState.mjSTATE_CTRL | mujoco.mjtState.mjSTATE_MOCAP_POS
        self._substeps = round(1.0 / (CONTROL_HZ * self.model.opt.timestep))
        nstate = mujoco.mj_stateSize(self.model, self._spec_state)
        B = self.num_envs
        self._state = np.zeros((B, nstate))  # f64 [B, nstate]: each environment's physics
        self._target = np.zeros((B, self.model.nu))  # f64 [B, 6]: servo targets
        self._mocap = np.zeros((B, 3 * self.model.nmocap))  # f64 [B, 3]: the goal marker
        self._sensors = np.zeros((B, self.model.nsensordata))
        self._elapsed = np.zeros(B, dtype=np.int64)
        self._rngs = [np.random.default_rng() for _ in range(B)]
        self._slices = {
            self.model.sensor(i).name: slice(
                self.model.sensor_adr[i], self.model.sensor_adr[i] + self.model.sensor_dim[i]
            )
            for i in range(self.model.nsensor)
        }
        self._joint_qpos = [self.model.jnt_qposadr[self.model.joint(j).id] for j in JOINTS]
        names = [f"{j}.pos" for j in JOINTS] + [f"{j}.vel" for j in JOINTS]
        self._state_cols = np.concatenate(
            [np.arange(self._slices[n].start, self._slices[n].stop) for n in names]
        )
        self._renderers: dict[int, mujoco.Renderer] = {}
        self._low = np.array([RANGES[j][0] for j in JOINTS])
        self._high = np.array([RANGES[j][1] for j in JOINTS])
        cams = (
            (CameraSpec("base_camera", cfg.image_size, cfg.image_size),)
            if cfg.obs_mode == "rgb"
            else ()
        )
        self.spec = EnvSpec(
            obs=ObsSpec(
                cameras=cams,
                state_names=tuple(f"{j}.pos" for j in JOINTS) + tuple(f"{j}.vel" for j in JOINTS),
                privileged={"tcp_pos": (3,), **{k: (n,) for k, n in self.task.privileged.items()}},
            ),
            action=ActionSpec(
                "joint_delta",
                JOINTS,
                (-MAX_DELTA,) * len(JOINTS),
                (MAX_DELTA,) * len(JOINTS),
                gripper=JOINTS.index("gripper"),
                control_hz=CONTROL_HZ,
            ),
            max_episode_steps=cfg.max_episode_steps or self.task.max_episode_steps,
            instructions=(self.task.instruction,),
        )

    # --- observations -------------------------------------------------------------------------
    def _read(self, name: str) -> np.ndarray:
        return self._sensors[:, self._slices[name]]

    def _obs(self) -> Observation:
        state = self._sensors[:, self._state_cols]  # f64 [B, 12]: one gather
        priv = {
            k: torch.from_numpy(self._read(k).astype(np.float32)) for k in self.spec.obs.privileged
        }
        images = (
            {"base_camera": self._render_all(self.cfg.image_size)} if self.spec.obs.cameras else {}
        )
        return Observation(
            state=torch.from_numpy(state.astype(np.float32)),
            instruction=[self.task.instruction] * self.num_envs,
            images=images,
            privileged=priv,
        )

    def _reward(self) -> tuple[np.ndarray, np.ndarray]:
        return self.task.evaluate({k: self._read(k) for k in self.spec.obs.privileged})

    # --- reset / step -------------------------------------------------------------------------
    def _reset_rows(self, ids: Sequence[int], seeds: Sequence[int | None]) -> None:
        d = self._data
        m = self.model
        for i, seed in zip(ids, seeds):
            if seed is not None:
                self._rngs[i] = np.random.default_rng(seed)
            rng = self._rngs[i]
            mujoco.mj_resetData(m, d)
            home = np.array([HOME[j] for j in JOINTS]) + rng.uniform(
                -self.cfg.home_noise, self.cfg.home_noise, len(JOINTS)
            )
            home = np.clip(home, self._low, self._high)
            d.qpos[self._joint_qpos] = home
            init = self.task.sample(rng)
            if "cube" in init:
                adr = m.jnt_qposadr[m.body("cube").jntadr[0]]
                d.qpos[adr : adr + 3] = init["cube"]  # position
                d.qpos[adr + 3 : adr + 7] = [1, 0, 0, 0]  # quaternion (w, x, y, z): no rotation
            d.mocap_pos[0] = init["goal"]
            d.ctrl[:] = home
            mujoco.mj_forward(m, d)
            mujoco.mj_getState(m, d, self._state[i], self._spec_state)
            self._target[i] = home
            self._mocap[i] = d.mocap_pos.reshape(-1)
            self._sensors[i] = d.sensordata
            self._elapsed[i] = 0

    def reset(
        self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None
    ) -> Observation:
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids]
        self._reset_rows(ids, reset_seeds(seed, ids))
        return self._obs()

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: f32 [B, 6] joint-position deltas in radians, within +-MAX_DELTA."""
        a = np.clip(actions.detach().cpu().numpy().astype(np.float64), -MAX_DELTA, MAX_DELTA)
        self._target = np.clip(self._target + a, self._low, self._high)
        control = np.concatenate([self._target, self._mocap], 1)[
            :, None
        ]  # f64 [B, 1, nu + 3]: held for every substep
        states, sensors = rollout.rollout(
            self.model,
            self._rollout_data,
            self._state,
            control,
            control_spec=self._control_spec,
            nstep=self._substeps,
        )
        self._state = states[:, -1].copy()  # f64 [B, nstate]
        self._sensors = sensors[:, -1].copy()  # f64 [B, nsensordata]
        self._elapsed += 1
        reward, success = self._reward()
        terminated = success & (not self.cfg.ignore_terminations)
        truncated = self._elapsed >= self.spec.max_episode_steps
        done = terminated | truncated
        final = None
        if done.any():
            final = self._obs()
            self._reset_rows(np.nonzero(done)[0].tolist(), [None] * int(done.sum()))
        obs = self._obs()
        if final is not None:
            final = final.where(torch.from_numpy(done), obs)  # ended rows: the last observation
        return StepOutput(
            obs=obs,
            reward=torch.from_numpy(reward),
            terminated=torch.from_numpy(terminated),
            truncated=torch.from_numpy(truncated),
            success=torch.from_numpy(success),
            final_obs=final,
            ended=torch.from_numpy(np.flatnonzero(done)) if final is not None else None,
        )

    # --- rendering ----------------------------------------------------------------------------
    def _render_all(self, size: int) -> torch.Tensor:
        if size not in self._renderers:
            self._renderers[size] = mujoco.Renderer(self.model, size, size)
        r = self._renderers[size]
        d = self._data
        frames = np.empty((self.num_envs, size, size, 3), dtype=np.uint8)  # uint8 [B, H, W, 3]
        for i in range(self.num_envs):  # one GL context renders each environment's state in turn
            mujoco.mj_setState(self.model, d, self._state[i], self._spec_state)
            d.mocap_pos[:] = self._mocap[i].reshape(-1, 3)
            mujoco.mj_forward(self.model, d)
            r.update_scene(d, camera="base_camera")
            frames[i] = r.render()
        return torch.from_numpy(frames)

    def render(self) -> torch.Tensor:
        return self._render_all(self.cfg.render_size)

    def close(self) -> None:
        for r in self._renderers.values():
            r.close()
        self._renderers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
