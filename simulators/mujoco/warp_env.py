"""``MuJoCoWarpEnv``: the MuJoCo arm tasks on MuJoCo Warp, all B worlds in one model and data on
one device (``env.device``: Warp's CPU device, or a CUDA GPU).

The same model, initial states, rewards and success as ``MuJoCoEnv`` (simulators/mujoco/
worlds.py, tasks.py); only the physics differs. Observations, rewards and success are computed in
torch on the device from zero-copy views of MuJoCo Warp's arrays (``wp.to_torch``), and actions
are written into its ``ctrl`` in place. On a GPU the physics substeps of a control step run as
one captured CUDA graph, and so does the forward pass after a reset, each launched on a side
stream (no graph can be captured on torch's legacy default stream) that events order after and
before torch's work, so neither waits on the host.

Host synchronisation: none in a step where no episode ends; the host counts each world's steps,
so it knows which truncate. With ``ignore_terminations=false`` the done mask is read once a step.
Buffer overflows and non-finite actions are tracked on the device and reach the host without a
wait (``warp_guard.StepGuard``): an error at the second reset or episode ending after them,
never a silent loss of contacts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, NamedTuple

import mujoco
import numpy as np
import torch

from embodied.compiling import compiled, own_code
from embodied.schema import Observation, StepOutput, host_to_device
from embodied.simulators.mujoco.arm import JOINTS
from embodied.simulators.mujoco.config import MuJoCoConfig
from embodied.simulators.mujoco.randomize import nominal
from embodied.simulators.mujoco.streams import Streams
from embodied.simulators.mujoco.tasks import TASKS
from embodied.simulators.mujoco.warp_guard import StepGuard
from embodied.simulators.mujoco.warp_randomize import BatchedWorlds
from embodied.simulators.mujoco.warp_render import WarpCameras
from embodied.simulators.mujoco.warp_setup import require_warp, timed_first_step, torch_device
from embodied.simulators.mujoco.worlds import (
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

# Constraint rows per world: twice the largest peak measured, 78 (push at 1024 worlds on an H200,
# where MuJoCo Warp's default of 64 overflowed; benchmarks/contact_peaks.py on the CPU, 512
# worlds: reach 58, push 62, pick 70). Contacts keep MuJoCo Warp's default, 48 per world pooled
# over the worlds, against a measured peak of 4.4 per world.
NJMAX = 160


class Outcome(NamedTuple):
    """What a step reads from the state its physics left (``_after_physics``)."""

    readings: dict[str, torch.Tensor]  # the sensors read: name -> f32 [B, n]
    state: torch.Tensor  # f32 [B, 12]: the observation's state
    reward: torch.Tensor  # f32 [B]
    success: torch.Tensor  # bool [B]
    terminated: torch.Tensor  # bool [B]: success, or none with ignore_terminations
    truncated: torch.Tensor  # bool [B]: the episode's last step


@cache
def _side_stream(device: torch.device) -> tuple[torch.cuda.Stream, Any]:
    """(torch's stream, Warp's wrapper of it) on which a CUDA device's graphs run, one pair per
    process: torch hands out its pooled streams in turn, so envs' own would coincide after 32,
    and a freed env's wrapper would unregister the stream another env captures on."""
    import warp as wp

    stream = torch.cuda.Stream(device)
    return stream, wp.stream_from_torch(stream)


class MuJoCoWarpEnv:
    def __init__(self, cfg: MuJoCoConfig):
        cfg.validate()
        self._wp, self._mjw = require_warp()
        self.device = torch_device(cfg.device)
        self.cfg = cfg
        # the function, not the bound method: an env holding its own method would be a cycle,
        # its device memory freed only by the cycle collector. Compiled (env.compile): lazily,
        # at the first step; the compiler is checked here, before the model is built
        self._outcome = MuJoCoWarpEnv._after_physics
        if cfg.compile:
            fn = own_code(self._outcome)  # (torch's cap of 8 versions counts this env's alone)
            self._outcome = compiled(fn, self.device, "env.compile", fullgraph=True)
        self.task = TASKS[cfg.task]
        self.num_envs = B = cfg.num_envs
        self.spec = make_spec(cfg, self.task)
        self.host_model = build_model(cfg, self.task)
        self._substeps = substeps(self.host_model)
        wp = self._wp
        self._wp_device = wp.device_from_torch(self.device)
        with wp.ScopedDevice(self._wp_device):
            self._m = self._mjw.put_model(self.host_model)
            self._d = self._mjw.make_data(
                self.host_model,
                nworld=B,
                nconmax=cfg.nconmax,
                njmax=NJMAX if cfg.njmax is None else cfg.njmax,
            )
            self._guard = StepGuard(wp, self._d, self.task.name, self.device)
            self._batched = None  # the randomised model fields, a row per world
            if cfg.randomize.active:
                nominal_fields = Randomized.of(self.host_model)
                self._batched = BatchedWorlds(wp, self._m, nominal_fields, B, self.device)
        self.world_params = nominal(B, self.device)  # each world's draw for its episode
        # f32 [D + 1, B, 6]: the servo targets of the last steps; a world's delay picks its row
        self._history = torch.zeros(
            cfg.randomize.action_delay + 1, B, len(JOINTS), device=self.device
        )
        self._worlds = torch.arange(B, device=self.device)
        self._bind_views()
        self._target = torch.zeros(B, len(JOINTS), device=self.device)  # f32 [B, 6]: servo targets
        self._elapsed = np.zeros(B, dtype=np.int64)  # on the host: it knows every truncation
        self._elapsed_device = torch.zeros(B, dtype=torch.int64, device=self.device)  # the same
        self._streams = Streams(B, self.device)
        self._low = torch.tensor(LOW, device=self.device)
        self._high = torch.tensor(HIGH, device=self.device)
        self._graphs: dict[str, Any] = {}  # name -> Warp's captured CUDA graph (_as_graph)
        if self.device.type == "cuda":  # the physics graph's stream (_physics)
            self._side_stream, self._wp_side_stream = _side_stream(self.device)
        self._cameras: dict[tuple, WarpCameras] = {}  # (size, camera names) -> render context
        # compile (or load) before a capture
        timed_first_step(self.task.name, self.device.type, self._substep_all)
        self._guard.restart_peaks()  # that step was from the model's own pose, not an episode's

    def _bind_views(self) -> None:
        """Torch views of MuJoCo Warp's arrays (no copies) and the columns read from them."""
        m = self.host_model
        to_torch = self._wp.to_torch
        self._qpos = to_torch(self._d.qpos)  # f32 [B, nq]
        self._ctrl = to_torch(self._d.ctrl)  # f32 [B, nu]
        self._mocap = to_torch(self._d.mocap_pos)  # f32 [B, nmocap, 3]
        self._sensors = to_torch(self._d.sensordata)  # f32 [B, nsensordata]
        self._joint_qpos = torch.tensor(
            [m.jnt_qposadr[m.joint(j).id] for j in JOINTS], device=self.device
        )
        self._cube_qpos = int(m.jnt_qposadr[m.body("cube").jntadr[0]]) if self._has_cube() else -1
        cols = {}
        for i in range(m.nsensor):
            adr = int(m.sensor_adr[i])
            cols[m.sensor(i).name] = list(range(adr, adr + int(m.sensor_dim[i])))
        cols["joints"] = [cols[f"{j}.pos"][0] for j in JOINTS]
        self._pos_cols = torch.tensor(cols["joints"], device=self.device)
        # f32 [B, 6]: the joints at the step's start (velocities as an arm measures them)
        self._previous = torch.zeros(self.num_envs, len(JOINTS), device=self.device)
        # what an observation and the task's reward read, gathered in one launch (_read):
        # "joints", the privileged keys and the task's reads, each a column range of the gather
        names = ["joints", *self.spec.obs.privileged]
        names += [k for k in self.task.reads if k not in names]
        self._read_cols = torch.tensor(sum((cols[k] for k in names), []), device=self.device)
        ends = np.cumsum([len(cols[k]) for k in names])
        self._read_ranges = {k: slice(e - len(cols[k]), e) for k, e in zip(names, ends.tolist())}

    def _has_cube(self) -> bool:
        return mujoco.mj_name2id(self.host_model, mujoco.mjtObj.mjOBJ_BODY, "cube") >= 0

    @contextlib.contextmanager
    def _on_torch_stream(self):
        """Warp work on the device queue torch uses, so both run in order without a wait."""
        wp = self._wp
        with wp.ScopedDevice(self._wp_device):
            if self.device.type == "cuda":
                with wp.ScopedStream(wp.stream_from_torch(torch.cuda.current_stream(self.device))):
                    yield
            else:
                yield

    # --- physics ------------------------------------------------------------------------------
    def _substep_all(self) -> None:
        with self._on_torch_stream():
            self._substeps_on_current_stream()

    def _substeps_on_current_stream(self) -> None:
        for _ in range(self._substeps):
            self._mjw.step(self._m, self._d)
            self._guard.track_peaks()

    def _physics(self) -> None:
        """One control step of physics: on a GPU one captured graph, else the substeps."""
        if self.device.type == "cuda":
            self._as_graph("physics", self._substeps_on_current_stream)
        else:
            self._substep_all()

    def _forward(self) -> None:
        """MuJoCo Warp's forward pass for every world: on a GPU a captured graph, because its
        solver loop (``capture_while``) waits on the host at every iteration outside a capture."""
        if self.device.type == "cuda":
            self._as_graph("forward", lambda: self._mjw.forward(self._m, self._d))
        else:
            with self._on_torch_stream():
                self._mjw.forward(self._m, self._d)

    def _as_graph(self, name: str, work: Callable[[], None]) -> None:
        """Run ``work`` (Warp launches only) as a CUDA graph captured at its first call."""
        wp = self._wp
        caller = torch.cuda.current_stream(self.device)
        # CUDA cannot capture on the legacy default stream torch uses: the graph runs on a side
        # stream, ordered after the caller's work and before what follows by events, no host wait
        self._side_stream.wait_stream(caller)
        # one Warp stream object throughout: Warp finds a capture in progress by that object
        with wp.ScopedDevice(self._wp_device), wp.ScopedStream(self._wp_side_stream):
            if name not in self._graphs:
                with wp.ScopedCapture(stream=self._wp_side_stream) as capture:
                    work()
                self._graphs[name] = capture.graph
            wp.capture_launch(self._graphs[name], stream=self._wp_side_stream)
        caller.wait_stream(self._side_stream)

    def simulate(self, targets: torch.Tensor) -> None:
        """The simulator alone: servo targets (f32 [B, 6], radians, on the device) held for one
        control step of physics; no observation, reward or reset (raw throughput)."""
        self._target = targets.to(self.device, torch.float32).clone()
        self._ctrl.copy_(self._target)
        self._physics()

    def _delayed(self) -> torch.Tensor:
        """f32 [B, 6]: the servo targets to hold, each world's of its ``delay`` steps ago (with
        no command delay configured, the targets themselves: no history is kept)."""
        if len(self._history) == 1:
            return self._target
        self._history = torch.roll(self._history, 1, 0)
        self._history[0] = self._target
        return self._history[self.world_params.delay, self._worlds]

    def check_buffers(self) -> None:
        """Raise BufferOverflow if any substep since construction needed more contacts or
        constraints than the buffers hold, or UserError if an action was not finite."""
        self._guard.check()

    @property
    def buffer_peaks(self) -> tuple[int, int]:
        """(contacts of all worlds, constraints of one world): the largest counts seen so far."""
        return self._guard.buffer_peaks

    # --- observations -------------------------------------------------------------------------
    def _read(self) -> dict[str, torch.Tensor]:
        """The sensors an observation and the reward read, copied out of the live data in one
        gather: name -> f32 [B, n] (views of one f32 [B, N])."""
        gathered = self._sensors.index_select(1, self._read_cols)
        return {k: gathered[:, at] for k, at in self._read_ranges.items()}

    def _obs(
        self, readings: dict[str, torch.Tensor] | None = None, state: torch.Tensor | None = None
    ) -> Observation:
        """The observation from this state's ``readings`` and ``state`` (``_after_physics``);
        None: read them now."""
        if readings is None or state is None:
            readings = self._read()
            state = self._state(readings["joints"])
        return Observation(
            state=state,  # f32 [B, 12]
            instruction=[self.task.instruction] * self.num_envs,
            images=self._images(),
            privileged={k: readings[k] for k in self.spec.obs.privileged},
        )

    def _state(self, joints: torch.Tensor) -> torch.Tensor:
        """f32 [B, 12]: joint positions, and their change over the step times the control rate."""
        return torch.cat([joints, (joints - self._previous) * CONTROL_HZ], 1)

    def _after_physics(self) -> Outcome:
        """The step counted, and what it reads from the new state. Through torch.compile with
        ``env.compile``: a few fused kernels instead of some 35 operators."""
        self._elapsed_device += 1
        readings = self._read()
        reward, success = self.task.evaluate(readings)
        truncated = self._elapsed_device >= self.spec.max_episode_steps
        terminated = torch.zeros_like(success) if self.cfg.ignore_terminations else success
        state = self._state(readings["joints"])
        return Outcome(readings, state, reward, success, terminated, truncated)

    def _images(self) -> dict[str, torch.Tensor]:
        if not self.spec.obs.cameras:
            return {}
        return self._render(self.cfg.image_size, tuple(self.cfg.cameras))

    def _render(self, size: int, cameras: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """camera -> uint8 [B, size, size, 3] on the device, all worlds in one ray-cast launch."""
        key = (size, cameras)
        if key not in self._cameras:
            with self._wp.ScopedDevice(self._wp_device):
                self._cameras[key] = WarpCameras(
                    self._wp, self._mjw, self.host_model, self.num_envs, cameras, size
                )
        self._pose()
        with self._on_torch_stream():
            return self._cameras[key].images(self._m, self._d)

    def _pose(self) -> None:
        """Every world's bodies, cameras and lights placed where its joints are now, as the
        rollout backend draws them: a step leaves them where its last substep began (MuJoCo
        places them before integrating), so without this a partial reset's forward pass would
        move the other worlds' images a substep on."""

        def place() -> None:
            self._mjw.kinematics(self._m, self._d)
            self._mjw.camlight(self._m, self._d)  # (fixed cameras: no subtree centres needed)

        if self.device.type == "cuda":
            self._as_graph("pose", place)
        else:
            with self._on_torch_stream():
                place()

    # --- reset / step -------------------------------------------------------------------------
    def _reset_rows(self, rows: np.ndarray) -> None:
        """Start new episodes in worlds ``rows`` (int64 [N] on the host): MuJoCo Warp's masked
        reset, then the drawn initial states, then one forward pass for the sensors."""
        self._elapsed[rows] = 0
        ids = host_to_device(torch.from_numpy(rows), self.device)  # long [N]
        mask = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        mask.index_fill_(0, ids, True)  # (a Python scalar set by index copies from the host)
        init = draw_initial(self._streams, self.task, ids, self.cfg.home_noise, self.cfg.randomize)
        self.world_params.put(ids, init.params)
        if self._batched is not None:
            self._batched.put(ids, init.params)
        kept_sensors = self._sensors.clone()  # the other worlds keep their last substep's sensors
        with self._on_torch_stream():
            self._mjw.reset_data(self._m, self._d, reset=self._wp.from_torch(mask))
        self._qpos[ids[:, None], self._joint_qpos] = init.joints
        if init.cube is not None:
            at = self._cube_qpos
            self._qpos[ids, at : at + 3] = init.cube
            self._qpos[ids, at + 3 : at + 7] = init.cube_quat
        self._mocap[ids, 0] = init.goal
        self._ctrl[ids] = init.joints
        self._target[ids] = init.joints
        self._history[:, ids] = init.joints
        self._forward()
        self._sensors.copy_(torch.where(mask[:, None], self._sensors, kept_sensors))
        self._previous[ids] = init.joints  # at rest: zero velocity
        self._elapsed_device.index_fill_(0, ids, 0)

    def reset(
        self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None
    ) -> Observation:
        # a look at the guard's flags (no wait): a round shorter than an episode ends none
        self._guard.check_lagged()
        ids = list(range(self.num_envs)) if env_ids is None else env_ids.tolist()  # (one read)
        reseed(self._streams, seed, ids)
        self._reset_rows(np.array(ids, dtype=np.int64))
        return self._obs()

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: f32 [B, 6] joint-position deltas in radians, within +-MAX_DELTA; a world's
        non-finite action acts as 0 and is an error at the next look (warp_guard.py)."""
        who = f"MuJoCo Warp task {self.task.name!r}"
        check_action_shape(who, actions, self.num_envs)  # (host metadata: no sync)
        delta = self._guard.finite(actions.to(self.device, torch.float32))
        delta = delta.clamp(-MAX_DELTA, MAX_DELTA)
        self._target = torch.clamp(self._target + delta, self._low, self._high)
        self._ctrl.copy_(self._delayed())  # held for every substep
        torch.index_select(self._sensors, 1, self._pos_cols, out=self._previous)
        self._physics()
        self._elapsed += 1
        readings, state, reward, success, terminated, truncated = self._outcome(self)
        done_host = self._elapsed >= self.spec.max_episode_steps  # the same rows, on the host
        if not self.cfg.ignore_terminations:
            done_host = done_host | self._guard.read_with(terminated)  # a read every step
        final = None
        ended = None
        if done_host.any():
            if self.cfg.ignore_terminations:
                self._guard.check_lagged()  # (no wait: the rows ended on the host's count)
            ended = torch.from_numpy(np.flatnonzero(done_host))  # long [n], CPU
            done = terminated | truncated
            final = self._obs(readings, state)
            self._reset_rows(ended.numpy())
        obs = self._obs() if final is not None else self._obs(readings, state)  # (resets: anew)
        if final is not None:
            final = final.where(done, obs)  # ended rows: the last observation
        return StepOutput(
            obs=obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            success=success,
            final_obs=final,
            ended=ended,
        )

    # --- rendering ----------------------------------------------------------------------------
    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [B or N, render_size, render_size, 3]: the front camera (evaluation videos);
        every world renders in one launch, so ``env_ids`` only picks rows."""
        frames = self._render(self.cfg.render_size, ("base_camera",))["base_camera"]
        return frames if env_ids is None else frames[env_ids.to(frames.device)]

    def close(self, error: BaseException | None = None) -> None:
        """Free the renderers; then check the guard a last time (the peaks may have grown past a
        buffer since the last look: BufferOverflow), unless it raised already.
        ``error``: one on its way out (``with`` passes it): what the check finds is printed
        beside it rather than raised over it (a one-line error would hide its traceback)."""
        self._cameras.clear()
        if self._guard.raised:
            return
        try:
            self.check_buffers()
        except Exception as found:  # (an overflow, or the device's own fault)
            if error is None:
                raise
            print(f"also: {found}", file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        self.close(exc)
