"""One ManiSkill3 environment (any number of sub-environments) seen through the contract.

``ManiSkillCore`` wraps the *unwrapped* ManiSkill env and owns: physical-unit actions, the
observation mapping, the time limit, automatic partial reset and ``final_obs``. It works on
torch tensors on the simulator's device, so the GPU backend never leaves the device. physx_cpu
simulates one environment per instance, so with ``sim_backend="physx_cpu"`` the core drives a
``SerialEnvs`` of single-environment instances (inside one subprocess worker) through the same
batched code path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from embodied.schema import (
    ActionSpec,
    CameraSpec,
    EnvSpec,
    Observation,
    ObsSpec,
    ended_rows,
    host_to_device,
)
from embodied.simulators.maniskill.serial import SerialEnvs
from embodied.simulators.maniskill.tasks import action_space, check_assets, instruction_for

# Tasks whose whole episode state is ManiSkill's state dict (bodies, joints, controller) and whose
# environments are built alike: a seeded reset draws each distinct seed once and copies the state
# to the other environments with that seed (tests/test_maniskill_seeds.py checks each one). Others
# reset each environment on its own: RollBall-v1 keeps a per-episode tensor (reached_status),
# PegInsertionSide-v1 and the YCB tasks build different objects per environment.
SHARED_RESET_TASKS = (
    "PushCube-v1",
    "PullCube-v1",
    "PickCube-v1",
    "StackCube-v1",
    "PickCubeSO100-v1",
    "PokeCube-v1",
    "PushT-v1",
    "PlaceSphere-v1",
    "LiftPegUpright-v1",
)
# Proprioception: robot joint state and the end-effector pose (a real arm has these through FK).
STATE_KEYS = (("agent", "qpos"), ("agent", "qvel"), ("extra", "tcp_pose"))
# Robots that LeRobot drives with the same joints: their state columns and actions are named after
# the joints ("shoulder_pan.pos", ...), as embodied.robots names a real arm's, so that a policy
# trained here deploys to the arm (or its twin) as it is. Other robots keep qpos_i / arm_i names.
JOINT_NAMED_ROBOTS = ("so100",)


@dataclass
class CoreOptions:
    task: str
    num_envs: int = 1
    obs_mode: str = (
        "state"  # "state", "rgb", or "rgb+state" (cameras and the full privileged state)
    )
    control_mode: str | None = None  # None: the task's default
    reward_mode: str = "normalized_dense"
    image_size: int = 128
    max_episode_steps: int | None = None  # None: the task's registered limit
    sim_backend: str = "physx_cpu"
    render_size: int = 256
    ignore_terminations: bool = (
        False  # episodes end only at the time limit; success is still reported
    )
    proprioception: tuple[str, ...] = (
        "qpos",
        "qvel",
        "tcp_pose",
    )  # which of STATE_KEYS form the state


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).float()  # float32 [B, D]


def _take_rows(tree: dict, rows: torch.Tensor) -> dict:
    """Rows ``rows`` (long [n]) of every tensor leaf of a state dict: leaves [n, D]."""
    if isinstance(tree, torch.Tensor):
        return tree[rows]
    return {k: _take_rows(v, rows) for k, v in tree.items()}


def _copy_rows(tree: dict, src: torch.Tensor, dst: torch.Tensor) -> dict:
    """A copy of every tensor leaf ([B, D]) with row ``dst[k]`` replaced by row ``src[k]``."""
    if isinstance(tree, torch.Tensor):
        out = tree.clone()
        out[dst] = tree[src]
        return out
    return {k: _copy_rows(v, src, dst) for k, v in tree.items()}


def _rng_states(env, rows: list[int]) -> list[tuple]:
    """(main, episode) numpy RNG states of environments ``rows``: ManiSkill draws an unseeded
    episode's seed from the main one (enhanced_determinism) and may draw during an episode from
    the episode one."""
    main = env._batched_main_rng
    episode = env._batched_episode_rng
    return [(main[j].get_state(), episode[j].get_state()) for j in rows]


def _set_rng_states(env, rows: list[int], states: list[tuple]) -> None:
    """Set them in place (ManiSkill keeps other references to the same RandomState objects)."""
    main = env._batched_main_rng
    episode = env._batched_episode_rng
    for j, (main_state, episode_state) in zip(rows, states):
        main[j].set_state(main_state)
        episode[j].set_state(episode_state)


def _make_env(opts: CoreOptions):
    """The ManiSkill env for ``opts`` (its time limit and auto-reset are ours); on physx_cpu one
    env per environment behind ``SerialEnvs``."""
    import gymnasium as gym

    ms_obs_mode = {"state": "state_dict", "rgb": "rgb", "rgb+state": "rgb+state_dict"}[
        opts.obs_mode
    ]
    # enhanced_determinism: an unseeded (automatic) reset draws its episode from the env's own
    # RNG, seeded by the last seeded reset; without it ManiSkill uses the process's global torch
    # RNG, which differs between runs and between worker layouts
    kwargs = dict(
        num_envs=opts.num_envs,
        obs_mode=ms_obs_mode,
        reward_mode=opts.reward_mode,
        sim_backend=opts.sim_backend,
        render_mode="rgb_array",
        human_render_camera_configs=dict(width=opts.render_size, height=opts.render_size),
        enhanced_determinism=True,
    )
    if opts.control_mode:
        kwargs["control_mode"] = opts.control_mode
    if "rgb" in opts.obs_mode:
        kwargs["sensor_configs"] = dict(width=opts.image_size, height=opts.image_size)
    if opts.sim_backend == "physx_cpu":
        kwargs["num_envs"] = 1
        return SerialEnvs([gym.make(opts.task, **kwargs).unwrapped for _ in range(opts.num_envs)])
    return gym.make(opts.task, **kwargs).unwrapped


class ManiSkillCore:
    def __init__(self, opts: CoreOptions):
        check_assets(opts.task)
        # one warning per environment about the missing CUDA renderer drowns the progress output
        logging.getLogger("mani_skill").setLevel(logging.ERROR)
        from mani_skill.utils.registration import REGISTERED_ENVS

        self.opts = opts
        self.env = _make_env(opts)
        self.device = self.env.device
        self.max_episode_steps = (
            opts.max_episode_steps or REGISTERED_ENVS[opts.task].max_episode_steps
        )
        self.instruction = instruction_for(opts.task)
        self._state_keys = tuple((g, k) for g, k in STATE_KEYS if k in opts.proprioception)
        agent = self.env.agent
        self._joints = (
            [j.name for j in agent.robot.get_active_joints()]
            if getattr(agent, "uid", None) in JOINT_NAMED_ROBOTS
            else None
        )
        self.action_spec, self._scale, self._offset = self._action_spec()
        # cached: no per-step host->device copy
        self._low, self._high = self.action_spec.bounds(self.device)
        self.elapsed = torch.zeros(opts.num_envs, dtype=torch.long, device=self.device)
        # the same counts on the host: with terminations ignored they alone decide which episodes
        # end, so a step on the GPU needs no synchronisation to find them
        self._elapsed_host = np.zeros(opts.num_envs, dtype=np.int64)
        # seeded resets copy one environment's episode to the others with the same seed
        self._share_resets = opts.task in SHARED_RESET_TASKS and self.env.reconfiguration_freq == 0
        # (seed 0: every core starts alike, so that equal seeds later give equal states, PhysX's
        # contact caches included; the first unseeded reset draws its seed from entropy)
        raw, _ = self.env.reset(seed=0)
        self._seeded = False  # no reset of the caller's yet
        self.spec = EnvSpec(
            obs=self._obs_spec(raw),
            action=self.action_spec,
            max_episode_steps=self.max_episode_steps,
            instructions=(self.instruction,),
        )

    # --- spec -------------------------------------------------------------------------
    def _action_spec(self):
        """Physical bounds per dimension from each sub-controller; where ManiSkill expects
        normalized [-1, 1] actions, ``env_action = scale * physical + offset``."""
        ctrl = self.env.agent.controller
        subs = ctrl.controllers if hasattr(ctrl, "controllers") else {"arm": ctrl}
        names = []
        low = []
        high = []
        scale = []
        offset = []
        gripper = None  # the gripper's action index
        for sub_name, c in subs.items():
            space = getattr(c, "_original_single_action_space", c.single_action_space)
            lo, hi = space.low.tolist(), space.high.tolist()
            if "gripper" in sub_name:
                gripper = len(names)
            names += [f"{sub_name}_{i}" for i in range(len(lo))] if len(lo) > 1 else [sub_name]
            for a, b in zip(lo, hi):
                low.append(a)
                high.append(b)
                if getattr(c, "_normalize_action", False):
                    scale.append(2.0 / (b - a))
                    offset.append(-(a + b) / (b - a))
                else:
                    scale.append(1.0)
                    offset.append(0.0)
        mode = self.env.control_mode
        if self._joints is not None and "joint" in mode and len(names) == len(self._joints):
            names = list(self._joints)  # one action per joint, in joint order
        # a delta controller without use_target adds to the joints as measured (pd_joint_delta_pos)
        deltas = [c.config for c in subs.values() if getattr(c.config, "use_delta", False)]
        measured = any(not getattr(config, "use_target", False) for config in deltas)
        spec = ActionSpec(
            space=action_space(mode),
            names=tuple(names),
            low=tuple(low),
            high=tuple(high),
            gripper=gripper,
            control_hz=float(self.env.control_freq),
            deltas_from="measured" if measured else "target",
        )
        to = dict(dtype=torch.float32, device=self.device)
        return spec, torch.tensor(scale, **to), torch.tensor(offset, **to)

    def _obs_spec(self, raw) -> ObsSpec:
        state_names = []
        suffix = {"qpos": "pos", "qvel": "vel"}
        for group, key in self._state_keys:
            if key in raw.get(group, {}):
                n = _flatten(raw[group][key]).shape[1]
                if self._joints is not None and key in suffix and n == len(self._joints):
                    state_names += [f"{j}.{suffix[key]}" for j in self._joints]
                else:
                    state_names += [f"{key}_{i}" for i in range(n)]
        state_keys = {k for _, k in STATE_KEYS}
        priv = {
            k: tuple(_flatten(v).shape[1:])
            for k, v in raw.get("extra", {}).items()
            if k not in state_keys
        }
        self._priv_keys = tuple(priv)  # object/goal state: simulator-only ground truth
        cams = tuple(
            CameraSpec(name, *v["rgb"].shape[1:3]) for name, v in raw.get("sensor_data", {}).items()
        )
        return ObsSpec(cameras=cams, state_names=tuple(state_names), privileged=priv)

    # --- conversion -----------------------------------------------------------------------
    def observation(self, raw) -> Observation:
        state = torch.cat(
            [_flatten(raw[g][k]) for g, k in self._state_keys if k in raw.get(g, {})], dim=1
        )  # f32 [B, S]
        priv = {k: _flatten(raw["extra"][k]) for k in self._priv_keys}
        images = {
            name: v["rgb"] for name, v in raw.get("sensor_data", {}).items()
        }  # uint8 [B, H, W, 3]
        return Observation(
            state=state,
            instruction=[self.instruction] * state.shape[0],
            images=images,
            privileged=priv,
        )

    # --- environment API ------------------------------------------------------------------
    def reset(self, seed=None, env_ids: torch.Tensor | None = None) -> Observation:
        """Reset all (or ``env_ids``) sub-environments; ``seed`` is an int, or one seed per reset
        environment. Returns the full batch.

        Equal seeds give equal initial states: with per-environment seeds each distinct seed is
        drawn once, by ManiSkill, in one environment, exactly as if that environment were reset
        alone with it (the seed fills ManiSkill's per-environment seed list, so the torch RNG,
        seeded from the list's first entry, and the environment's own numpy RNG both get it), and
        that state (bodies, joints, controller targets, RNGs) is copied to the other environments
        with the same seed. ManiSkill resets: one per distinct seed, whatever the batch size."""
        if env_ids is not None and len(env_ids) == 0:  # (a worker none of whose rows resets)
            return self.observation(self.env.get_obs())
        options = {} if env_ids is None else {"env_idx": env_ids.to(self.device)}
        if seed is None and not self._seeded:
            # the first episodes from the OS's entropy (as on MuJoCo and LIBERO), unseeded ones
            # on from them: from the start-up's seed 0 every worker repeated one sequence
            seed = int(np.random.default_rng().integers(2**31))
        self._seeded = True
        if seed is None or self.opts.num_envs == 1 or (isinstance(seed, int) and env_ids is None):
            # one call; with several sub-environments ManiSkill derives a deterministic seed for
            # each from the int
            first = seed if seed is None or isinstance(seed, int) else int(seed[0])
            raw, _ = self.env.reset(seed=first, options=options)
        else:
            ids = list(range(self.opts.num_envs)) if env_ids is None else env_ids.tolist()
            seeds = [seed + i for i in ids] if isinstance(seed, int) else list(seed)  # (by id)
            raw = self._reset_seeded(ids, [int(s) for s in seeds])
        if env_ids is None:
            self.elapsed.zero_()
            self._elapsed_host[:] = 0
        else:
            self.elapsed[env_ids.to(self.device)] = 0
            self._elapsed_host[env_ids.cpu().numpy()] = 0
        return self.observation(raw)

    def _reset_seeded(self, ids: list[int], seeds: list[int]) -> dict:
        """Reset environment ``ids[k]`` with ``seeds[k]``, as if alone; -> raw observation of the
        whole batch. One ManiSkill reset per distinct seed (per environment where
        ``SHARED_RESET_TASKS`` does not list the task), then one state copy for the rest."""
        B = self.opts.num_envs
        groups: dict[int, list[int]] = {}  # seed -> the environments it resets, first one drawn
        if self._share_resets:
            for i, s in zip(ids, seeds):
                groups.setdefault(s, []).append(i)
            group_list = list(groups.items())
        else:
            group_list = [(s, [i]) for i, s in zip(ids, seeds)]
        # A seeded reset re-seeds every environment's RNGs, reset or not: keep the others' states
        reset = set(ids)
        others = [j for j in range(B) if j not in reset]
        kept = _rng_states(self.env, others)
        drawn = []  # (main, episode) RNG states of each group's drawn environment
        for s, rows in group_list:
            # [s] * B: the torch RNG is seeded from entry 0 and the environment's numpy RNGs from
            # its own entry, so the episode is the one a lone environment gets from seed s
            raw, _ = self.env.reset(
                seed=[s] * B, options={"env_idx": torch.tensor(rows[:1], device=self.device)}
            )
            drawn.append(_rng_states(self.env, rows[:1])[0])
        src = [rows[0] for _, rows in group_list for _ in rows[1:]]
        dst = [j for _, rows in group_list for j in rows[1:]]
        if dst:
            raw = self._copy_state(src, dst)
        for (_, rows), state in zip(group_list, drawn):
            _set_rng_states(self.env, rows, [state] * len(rows))
        _set_rng_states(self.env, others, kept)
        return raw

    def _copy_state(self, src: list[int], dst: list[int]) -> dict:
        """Give environment ``dst[k]`` the state of ``src[k]``; -> the batch's raw observation,
        recomputed. The state is ManiSkill's state dict (every non-static actor's pose and
        velocities, every articulation's root pose, velocities, qpos and qvel) plus the controller
        state (the drive targets of ``*_target_*`` controllers; the others recompute theirs from
        the joints at the next action). Tasks that keep other per-episode data are left out of
        ``SHARED_RESET_TASKS``. ManiSkill's own step counter is not copied: the core counts."""
        # ManiSkill's masked writes fill the selected environments in increasing order
        order = sorted(range(len(dst)), key=dst.__getitem__)
        src_t = torch.tensor([src[k] for k in order], dtype=torch.long, device=self.device)
        dst_t = torch.tensor([dst[k] for k in order], dtype=torch.long, device=self.device)
        state = self.env.get_state_dict()  # leaves [B, D]
        controller = state.pop("controller", None)
        self.env.set_state_dict(_take_rows(state, src_t), dst_t)
        if controller:
            self.env.agent.set_controller_state(_copy_rows(controller, src_t, dst_t))
        return self.env.get_obs()

    def step(self, actions: torch.Tensor, env_ids: torch.Tensor | None = None):
        """actions: float32 [n, A] physical units for all environments, or for ``env_ids`` (long
        [n] on the CPU, SerialEnvs only) -> (obs, reward, terminated, truncated, success,
        final_obs, ended), n rows each; ``ended`` as ``StepOutput.ended`` (positions in the n)."""
        a = torch.clamp(actions.to(self.device), self._low, self._high) * self._scale + self._offset
        if env_ids is None:
            raw, reward, terminated, _, info = self.env.step(a)
            rows = host_rows = slice(None)
        else:
            raw, reward, terminated, _, info = self.env.step(a, env_ids.tolist())
            rows = env_ids
            host_rows = env_ids.numpy()
        self.elapsed[rows] += 1
        self._elapsed_host[host_rows] += 1
        obs = self.observation(raw)
        if "success" in info:
            success = info["success"].to(torch.bool)
        else:
            success = torch.zeros_like(terminated, dtype=torch.bool)
        if self.opts.ignore_terminations:
            terminated = torch.zeros_like(success)
        else:
            terminated = terminated.to(torch.bool)
        truncated = (self.elapsed[rows] >= self.max_episode_steps) & ~terminated
        if self.opts.ignore_terminations:
            # only the time limit ends episodes, and the host counts it too: no device sync
            over = np.flatnonzero(self._elapsed_host[host_rows] >= self.max_episode_steps)
            ended = torch.from_numpy(over) if len(over) else None
        else:
            # one host sync per step to find the ended episodes (ManiSkill's vector env does too)
            ended = ended_rows(terminated | truncated)
        final_obs = None
        if ended is not None:
            final_obs, obs = self._auto_reset(obs, ended, env_ids)
        return obs, reward.float(), terminated, truncated, success, final_obs, ended

    def _auto_reset(
        self, obs: Observation, ended: torch.Tensor, env_ids: torch.Tensor | None
    ) -> tuple[Observation, Observation]:
        """Reset the ``ended`` rows (long [n] on the CPU, positions in ``obs``'s rows: all, or
        ``env_ids``) -> (final_obs, the new obs). The ended rows' images are copied before the
        reset: on physx_cuda they are views of the cameras' render buffer, which the reset's
        observation renders over (state and privileged are computed anew each step). A copy of n
        rows on the device, no wait for it; the same code runs on physx_cpu."""
        at = host_to_device(ended, self.device)  # long [n]
        last = {k: v.index_select(0, at) for k, v in obs.images.items()}  # uint8 [n, H, W, 3]
        reset_ids = ended if env_ids is None else env_ids.cpu()[ended]
        full = self.reset(env_ids=reset_ids)  # the full batch, ended rows reset
        new = full if env_ids is None else full.index(env_ids)
        final = Observation(
            state=obs.state,
            instruction=obs.instruction,
            images={k: new.images[k].index_copy(0, at, last[k]) for k in last},
            privileged=obs.privileged,
        )
        return final, new

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [B or N, H, W, 3]; on physx_cuda every scene renders at once and ``env_ids``
        picks rows, on physx_cpu only ``env_ids``' environments render."""
        if isinstance(self.env, SerialEnvs):
            return self.env.render(env_ids)
        frames = self.env.render()  # uint8 [B, H, W, 3]
        return frames if env_ids is None else frames[env_ids.to(frames.device)]

    def close(self) -> None:
        self.env.close()
