"""``ManiSkillEnv``: a VecEnv over ManiSkill3 with two backends.

- ``gpu``: physx_cuda batches all environments in this process; tensors stay on the GPU.
- ``cpu``: physx_cpu allows one environment per ManiSkill instance, so environments live in
  subprocess workers (several per worker), stepped in lockstep; arrays cross as numpy.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from embodied.schema import Observation, SimulatorConfig, StepOutput, reset_seeds
from embodied.simulators.maniskill.core import CoreOptions, ManiSkillCore, check_assets


@dataclass
class ManiSkillConfig(SimulatorConfig):
    """Which ManiSkill3 task to run and how."""

    simulator: str = "maniskill"
    task: str = "PushCube-v1"  # any ManiSkill3 task id whose assets are installed
    # several tasks at once (multi-task training): num_envs is split evenly between them, in order,
    # and `task` is ignored; the framework composes one env per task (embodied.multitask)
    tasks: list[str] = field(default_factory=list)
    num_envs: int = 8  # environments stepped in lockstep
    backend: str = "cpu"  # "cpu": physx_cpu in subprocess workers; "gpu": physx_cuda, batched
    num_workers: int = 2  # cpu backend: subprocesses sharing the environments
    # "state" (proprioception + privileged), "rgb" (cameras + proprioception; privileged holds only
    # what ManiSkill gives image-based agents, e.g. goal_pos), or "rgb+state" (cameras and the full
    # privileged state: a state-based expert can act while the cameras record, for demonstrations)
    obs_mode: str = "state"
    control_mode: str | None = None  # None: the task's default controller
    reward_mode: str = "normalized_dense"
    image_size: int = 128  # camera height = width for obs_mode=rgb
    max_episode_steps: int | None = None  # None: the task's registered limit
    render_size: int = 256  # evaluation video frame size
    # Success does not end the episode: it runs to the time limit and the dense reward keeps paying
    # for staying successful (as ManiSkill's PPO baseline trains). With terminations on, reaching
    # the goal ends the reward stream, and a policy can earn more by hovering just short of it.
    ignore_terminations: bool = False

    def validate(self) -> None:
        if self.backend not in ("cpu", "gpu"):
            raise ValueError(f"backend: must be 'cpu' or 'gpu', got {self.backend!r}")
        if self.obs_mode not in ("state", "rgb", "rgb+state"):
            raise ValueError(f"obs_mode: must be 'state', 'rgb' or 'rgb+state', got {self.obs_mode!r}")
        if self.tasks and self.num_envs % len(self.tasks):
            raise ValueError(f"num_envs: {self.num_envs} environments do not split evenly between {len(self.tasks)} tasks")
        for name in ("num_envs", "num_workers", "image_size", "render_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


WORKER_START_TIMEOUT_S = 300.0  # building a task (and its renderer) takes seconds; minutes means something is wrong


def _core_options(cfg: ManiSkillConfig, num_envs: int, sim_backend: str) -> CoreOptions:
    return CoreOptions(task=cfg.task, num_envs=num_envs, obs_mode=cfg.obs_mode, control_mode=cfg.control_mode,
                       reward_mode=cfg.reward_mode, image_size=cfg.image_size, max_episode_steps=cfg.max_episode_steps,
                       sim_backend=sim_backend, render_size=cfg.render_size, ignore_terminations=cfg.ignore_terminations)


# ---------------------------------------------------------------------------------------------
# CPU worker: one ManiSkillCore over a SerialEnvs of single-environment instances.
def _pack(obs: Observation) -> dict:
    return {"state": obs.state.numpy(), "images": {k: v.numpy() for k, v in obs.images.items()},
            "privileged": {k: v.numpy() for k, v in obs.privileged.items()}}


def _cat(packs: list[dict]) -> dict:
    if len(packs) == 1:
        return packs[0]
    return {"state": np.concatenate([p["state"] for p in packs]),
            "images": {k: np.concatenate([p["images"][k] for p in packs]) for k in packs[0]["images"]},
            "privileged": {k: np.concatenate([p["privileged"][k] for p in packs]) for k in packs[0]["privileged"]}}


@torch.no_grad()  # no autograd bookkeeping for the simulator's many small tensor ops
def _worker(conn, opts: CoreOptions) -> None:
    torch.set_num_threads(1)
    try:
        core = ManiSkillCore(opts)
        everyone = list(range(opts.num_envs))
        conn.send(("ok", core.spec))
        while True:
            cmd, arg = conn.recv()
            if cmd == "step":
                ids, actions = arg  # local environment indices and their actions f32 [n, A]
                obs, reward, term, trunc, success, final = core.step(
                    torch.from_numpy(actions), None if ids == everyone else torch.tensor(ids))
                scalars = torch.stack([reward, term.float(), trunc.float(), success.float()], 1).numpy()
                conn.send(("ok", (_pack(obs), scalars, None if final is None else _pack(final))))  # scalars: f32 [n, 4]
            elif cmd == "reset":
                ids, seeds = arg  # local env indices, one seed (or None) each; all None or all set
                env_ids = torch.tensor(ids, dtype=torch.long)
                obs = core.reset(env_ids=env_ids) if None in seeds or not seeds else core.reset(seed=seeds, env_ids=env_ids)
                conn.send(("ok", _pack(obs)))
            elif cmd == "render":
                conn.send(("ok", core.render().numpy()))
            elif cmd == "close":
                core.close()
                conn.send(("ok", None))
                return
    except (KeyboardInterrupt, EOFError):
        return
    except Exception:  # report to the parent instead of dying silently
        conn.send(("error", traceback.format_exc()))


class ManiSkillEnv:
    """VecEnv over a ManiSkill3 task (see module docstring for the backends)."""

    def __init__(self, cfg: ManiSkillConfig):
        cfg.validate()
        check_assets(cfg.task)  # fail here, before any worker starts
        self.cfg, self.num_envs = cfg, cfg.num_envs
        self.can_step_subsets = cfg.backend == "cpu"  # step_async/step_wait (pipelined collection)
        if cfg.backend == "gpu":
            if not torch.cuda.is_available():
                raise RuntimeError("env.backend=gpu needs a CUDA GPU; use env.backend=cpu on this machine")
            self._core = ManiSkillCore(_core_options(cfg, cfg.num_envs, "physx_cuda"))
            self.device, self.spec = torch.device(self._core.device), self._core.spec
            return
        self._core, self.device = None, torch.device("cpu")
        n_workers = min(cfg.num_workers, cfg.num_envs)
        self._counts = [len(a) for a in np.array_split(np.arange(cfg.num_envs), n_workers)]
        self._starts = np.cumsum([0] + self._counts)
        ctx = mp.get_context("spawn")  # fork after SAPIEN/Vulkan start-up is unsafe
        self._conns, self._procs = [], []
        for count in self._counts:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, _core_options(cfg, count, "physx_cpu")), daemon=True)
            p.start()
            child.close()  # only the worker holds its end: if it dies, recv() here ends with EOFError
            self._conns.append(parent), self._procs.append(p)
        try:
            self.spec = [self._recv(c, timeout=WORKER_START_TIMEOUT_S) for c in self._conns][0]
        except BaseException:
            self.close()
            raise
        self._everyone, self._splits = torch.arange(cfg.num_envs), {}

    # --- transport ----------------------------------------------------------------------
    def _recv(self, conn, timeout: float | None = None):
        if timeout is not None and not conn.poll(timeout):
            raise RuntimeError(f"a ManiSkill worker did not start within {timeout:.0f} s. Workers are spawned: a script "
                               "that creates environments must guard its top level with `if __name__ == '__main__':`")
        try:
            status, payload = conn.recv()
        except EOFError:
            raise RuntimeError("a ManiSkill worker process died (see its output above; a script that creates "
                               "environments must guard its top level with `if __name__ == '__main__':`)") from None
        if status == "error":
            raise RuntimeError(f"ManiSkill worker failed:\n{payload}")
        return payload

    def _obs(self, packed: dict, n: int | None = None) -> Observation:
        return Observation(
            state=torch.from_numpy(packed["state"]),  # f32 [B, S]
            instruction=[self.spec.instructions[0]] * (n or self.num_envs),
            images={k: torch.from_numpy(v) for k, v in packed["images"].items()},  # uint8 [B, H, W, 3]
            privileged={k: torch.from_numpy(v) for k, v in packed["privileged"].items()},
        )

    # --- VecEnv ---------------------------------------------------------------------------
    def reset(self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None) -> Observation:
        ids = list(range(self.num_envs)) if env_ids is None else [int(i) for i in env_ids.tolist()]
        seeds = reset_seeds(seed, ids)
        if self._core is not None:  # an int seeds the whole batch in one call (see ManiSkillCore.reset)
            return self._core.reset(seed=seed if isinstance(seed, int) or seed is None else seeds,
                                    env_ids=None if env_ids is None else env_ids.to(self.device))
        for w, conn in enumerate(self._conns):
            lo, hi = self._starts[w], self._starts[w + 1]
            mine = [(i - lo, s) for i, s in zip(ids, seeds) if lo <= i < hi]
            conn.send(("reset", ([i for i, _ in mine], [s for _, s in mine])))
        return self._obs(_cat([self._recv(c) for c in self._conns]))

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: float32 [B, A] physical units."""
        if self._core is not None:
            obs, reward, term, trunc, success, final = self._core.step(actions)
            return StepOutput(obs=obs, reward=reward, terminated=term, truncated=trunc, success=success, final_obs=final)
        self.step_async(actions, self._everyone)
        return self.step_wait(self._everyone)

    # --- pipelining (cpu backend): step a subset while the caller works on another ------------
    def _split(self, env_ids: torch.Tensor) -> list[tuple[int, list[int], list[int]]]:
        """(worker, local ids, positions in env_ids) for each worker that holds some of env_ids.
        Cached per id set: a rollout steps the same sets (all, or its pipeline groups) every step."""
        ids = env_ids.tolist()
        key = tuple(ids)
        if key not in self._splits:
            self._splits[key] = self._split_uncached(ids)
        return self._splits[key]

    def _split_uncached(self, ids: list[int]) -> list[tuple[int, list[int], list[int]]]:
        out = []
        for w in range(len(self._conns)):
            lo, hi = self._starts[w], self._starts[w + 1]
            pos = [j for j, i in enumerate(ids) if lo <= i < hi]
            if pos:
                out.append((w, [ids[j] - lo for j in pos], pos))
        return out

    def step_async(self, actions: torch.Tensor, env_ids: torch.Tensor) -> None:
        """Start stepping environments ``env_ids`` (long [N], ascending) with actions f32 [N, A];
        workers queue requests in order, so several subsets may be in flight."""
        if self._core is not None:
            raise NotImplementedError("the gpu backend steps all environments at once; use step()")
        a = actions.detach().to("cpu", torch.float32).numpy()
        for w, local, pos in self._split(env_ids):
            self._conns[w].send(("step", (local, a[pos])))

    def step_wait(self, env_ids: torch.Tensor) -> StepOutput:
        """Finish the ``step_async`` of ``env_ids``; every tensor has N = len(env_ids) rows."""
        results = [self._recv(self._conns[w]) for w, _, _ in self._split(env_ids)]
        n = len(env_ids)
        scalars = torch.from_numpy(np.concatenate([r[1] for r in results]))  # f32 [N, 4]
        obs = self._obs(_cat([r[0] for r in results]), n)
        final = None
        if any(r[2] is not None for r in results):
            final = self._obs(_cat([r[2] if r[2] is not None else r[0] for r in results]), n)
        return StepOutput(obs=obs, reward=scalars[:, 0].contiguous(), terminated=scalars[:, 1] > 0,
                          truncated=scalars[:, 2] > 0, success=scalars[:, 3] > 0, final_obs=final)

    def render(self) -> torch.Tensor:
        """uint8 [B, H, W, 3] frames of the task's render camera."""
        if self._core is not None:
            return self._core.render()
        for conn in self._conns:
            conn.send(("render", None))
        return torch.from_numpy(np.concatenate([self._recv(c) for c in self._conns]))

    def close(self) -> None:
        if self._core is not None:
            self._core.close()
            return
        for conn, proc in zip(self._conns, self._procs):
            try:
                conn.send(("close", None))
                if conn.poll(10):
                    conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
        self._conns, self._procs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_env(cfg: ManiSkillConfig, **overrides) -> ManiSkillEnv:
    return ManiSkillEnv(replace(cfg, **overrides) if overrides else cfg)
