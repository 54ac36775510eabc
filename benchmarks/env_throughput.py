"""Environment throughput: raw simulator steps/s vs the same steps through our adapter, side by
side.

MuJoCo (all environments in this process):
  raw      the desktop-arm model stepped with ``mujoco.rollout`` for all environments (same
           substeps per control step), random servo targets, sensors read; rgb adds one offscreen
           render per environment per step, as the adapter does
  adapter  ``MuJoCoEnv.step`` with random actions: the same physics plus the contract's work
           (action clipping, observation tensors, reward/success, time limits, auto-reset)
LIBERO and ManiSkill (CPU simulators in subprocess workers):
  raw      the simulator's own envs stepped one after the other in this process with random
           actions (LIBERO: ``OffScreenRenderEnv``; ManiSkill: physx_cpu gym envs, reset every 50)
  adapter  our VecEnv with the same environments in this process (``num_workers=0``: the
           adapter's own overhead), in 1 worker (plus a round trip between processes per step) and
           in 2 workers (what parallel workers buy on this machine)
All variants of a row run alternately, several repeats; the median of per-repeat ratios is the
headline (the machine's speed drifts).

    python benchmarks/env_throughput.py [--simulators mujoco libero maniskill] [--modes state rgb]
        [--repeats 3] [--worker-envs 4 16] [--round-trip]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _raw(env, steps: int, rgb: bool) -> float:
    """Seconds for ``steps`` control steps of all environments straight through mujoco.rollout."""
    import mujoco
    from mujoco import rollout

    B = env.num_envs
    nu = env.model.nu
    env.reset(seed=0)
    # start from the adapter's current states
    state = env._state.copy()  # f64 [B, nstate]
    mocap = env._mocap.copy()  # f64 [B, 3]
    renderer = mujoco.Renderer(env.model, env.cfg.image_size, env.cfg.image_size) if rgb else None
    data = [mujoco.MjData(env.model)]
    scratch = mujoco.MjData(env.model)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    target = env._target.copy()  # f64 [B, 6]
    low = env._low
    high = env._high
    for _ in range(
        steps
    ):  # the same motion as the adapter's: random deltas added to the servo targets
        target = np.clip(target + rng.uniform(-0.1, 0.1, (B, nu)), low, high)
        control = np.concatenate([target, mocap], 1)[:, None]
        states, sensors = rollout.rollout(
            env.model, data, state, control, control_spec=env._control_spec, nstep=env._substeps
        )
        state = states[:, -1].copy()
        _ = torch.from_numpy(sensors[:, -1].astype(np.float32))
        if renderer is not None:
            for i in range(B):
                mujoco.mj_setState(env.model, scratch, state[i], env._spec_state)
                mujoco.mj_forward(env.model, scratch)
                renderer.update_scene(scratch, camera="base_camera")
                renderer.render()
    elapsed = time.perf_counter() - t0
    if renderer is not None:
        renderer.close()
    return elapsed


def _adapter(env, steps: int) -> float:
    env.reset(seed=0)
    g = torch.Generator().manual_seed(0)
    low, high = env.spec.action.bounds()
    t0 = time.perf_counter()
    for _ in range(steps):
        env.step(low + (high - low) * torch.rand(env.num_envs, env.spec.action.dim, generator=g))
    return time.perf_counter() - t0


class _LiberoRaw:
    """n plain LIBERO envs in this process (as LIBERO's own evaluation scripts step them)."""

    def __init__(self, n: int, rgb: bool, size: int):
        from embodied.simulators.libero.core import load_task

        _, bddl, init = load_task("libero_spatial", 0)
        from libero.libero.envs import OffScreenRenderEnv

        self.envs = [
            OffScreenRenderEnv(
                bddl_file_name=bddl,
                camera_heights=size,
                camera_widths=size,
                use_camera_obs=rgb,
                has_offscreen_renderer=rgb,
                ignore_done=True,
                hard_reset=False,
            )
            for _ in range(n)
        ]
        for i, e in enumerate(self.envs):
            e.seed(i)
            e.reset()
            e.set_init_state(init[i])
        self.rng = np.random.default_rng(0)

    def run(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            for e in self.envs:
                e.step(self.rng.uniform(-1, 1, 7))
        return time.perf_counter() - t0

    def close(self):
        for e in self.envs:
            e.close()


class _ManiSkillRaw:
    """n plain physx_cpu ManiSkill envs in this process, reset every 50 steps (the time limit)."""

    def __init__(self, task: str, n: int, rgb: bool, size: int):
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401

        kwargs = dict(
            num_envs=1,
            obs_mode="rgb" if rgb else "state_dict",
            control_mode="pd_joint_delta_pos",
            reward_mode="normalized_dense",
            sim_backend="physx_cpu",
        )
        if rgb:
            kwargs["sensor_configs"] = dict(width=size, height=size)
        self.envs = [gym.make(task, **kwargs).unwrapped for _ in range(n)]
        for i, e in enumerate(self.envs):
            e.reset(seed=i)
        self.t = 0

    @torch.no_grad()
    def run(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.t += 1
            for e in self.envs:
                e.step(torch.rand(1, e.action_space.shape[-1]) * 2 - 1)
                if self.t % 50 == 0:
                    e.reset()
        return time.perf_counter() - t0

    def close(self):
        for e in self.envs:
            e.close()


def _worker_rows(
    name: str, task: str, mode: str, n: int, steps: int, repeats: int, raw, make_env
) -> None:
    """Raw vs our VecEnv in this process (0 workers) and in 1 and 2 workers, alternating; one table
    row per worker count."""
    envs = {w: make_env(w) for w in (0, 1, 2)}
    try:
        raw.run(2)  # warm-up
        for e in envs.values():
            _adapter(e, 2)
        rates = {k: [] for k in ("raw", *envs)}
        for _ in range(repeats):
            rates["raw"].append(steps * n / raw.run(steps))
            for w, e in envs.items():
                rates[w].append(steps * n / _adapter(e, steps))
        r = statistics.median(rates["raw"])
        for w in envs:
            ratio = statistics.median([a / b for a, b in zip(rates[w], rates["raw"])])
            print(
                f"| {name} | {task} | {mode} | {n} | {w or '0 (in process)'} | {r:.1f} | "
                f"{statistics.median(rates[w]):.1f} | {ratio:.3f} |",
                flush=True,
            )
    finally:
        raw.close()
        for e in envs.values():
            e.close()


def _busy_server(conn) -> None:
    """Answer each message after busy-working for the number of milliseconds it names."""
    while (ms := conn.recv()) is not None:
        t = time.perf_counter()
        while time.perf_counter() - t < ms / 1e3:
            pass
        conn.send(b"ok")


def _round_trip_rows(work_ms=(0.0, 2.0, 8.0), trips: int = 200, repeats: int = 3) -> None:
    """What one request/answer between two processes costs on this machine beyond the worker's own
    work, with no simulator and a 2-byte payload: the floor under any subprocess VecEnv's step."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_busy_server, args=(there,), daemon=True)
    proc.start()
    here.send(0.0)
    here.recv()
    excess = {ms: [] for ms in work_ms}
    for _ in range(repeats):
        for ms in work_ms:
            t = time.perf_counter()
            for _ in range(trips):
                here.send(ms)
                here.recv()
            excess[ms].append((time.perf_counter() - t) / trips * 1e3 - ms)
    here.send(None)
    proc.join()
    print(
        "\n| worker's work per request (ms) | round trip beyond the work (ms, median) |\n"
        "|---:|---:|"
    )
    for ms, v in excess.items():
        print(f"| {ms:.0f} | {statistics.median(v):.3f} |", flush=True)


def main() -> None:
    # The summary sentence (wrapped over two lines; argparse re-flows it).
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulators", nargs="+", default=["mujoco", "libero", "maniskill"])
    ap.add_argument("--num-envs", type=int, default=16, help="MuJoCo (in process)")
    ap.add_argument(
        "--worker-envs",
        type=int,
        nargs="+",
        default=[4],
        help="LIBERO and ManiSkill (in workers): one row per count; a worker's round trip costs "
        "about the same whatever it carries, so its share falls as environments per worker rise",
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["state", "rgb"])
    ap.add_argument("--task", default="push", help="MuJoCo task")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument(
        "--round-trip",
        action="store_true",
        help="also measure a bare pipe round trip between two processes",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}"
    )
    print(
        "| simulator | task | obs | envs | workers | raw steps/s (1 process) | adapter steps/s | "
        "ratio (median) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        if "mujoco" in args.simulators:
            _mujoco_row(args, mode)
        for n in args.worker_envs:
            _worker_simulators(args, mode, n)
    if args.round_trip:
        _round_trip_rows()


def _worker_simulators(args, mode: str, n: int) -> None:
    """LIBERO and ManiSkill rows for n environments (in 1 and in 2 workers)."""
    rgb = mode == "rgb"
    if "libero" in args.simulators:
        from embodied.multitask import make_env
        from embodied.simulators.libero import LiberoConfig

        steps = max(5, args.steps // (40 if rgb else 4))
        cfg = dict(
            suite="libero_spatial",
            task_id=0,
            obs_mode=mode,
            image_size=args.image_size,
            num_envs=n,
            max_episode_steps=10**6,
        )  # no resets inside the measurement (the raw loop has none)
        _worker_rows(
            "libero",
            "spatial/0",
            mode,
            n,
            steps,
            args.repeats,
            _LiberoRaw(n, rgb, args.image_size),
            lambda w: make_env(LiberoConfig(**cfg, num_workers=w)),
        )
    if "maniskill" in args.simulators:
        from embodied.multitask import make_env
        from embodied.simulators.maniskill import ManiSkillConfig

        steps = args.steps if not rgb else max(10, args.steps // 4)
        cfg = dict(
            task="PushCube-v1",
            obs_mode=mode,
            control_mode="pd_joint_delta_pos",
            image_size=args.image_size,
            num_envs=n,
        )
        _worker_rows(
            "maniskill",
            "PushCube-v1",
            mode,
            n,
            steps,
            args.repeats,
            _ManiSkillRaw("PushCube-v1", n, rgb, args.image_size),
            lambda w: make_env(ManiSkillConfig(**cfg, num_workers=w)),
        )


def _mujoco_row(args, mode: str) -> None:
    from embodied.simulators.mujoco import MuJoCoConfig, MuJoCoEnv

    steps = args.steps if mode == "state" else max(10, args.steps // 10)
    with MuJoCoEnv(MuJoCoConfig(task=args.task, num_envs=args.num_envs, obs_mode=mode)) as env:
        env.reset(seed=0)
        # warm-up (renderer contexts, caches)
        _adapter(env, 5)
        _raw(env, 5, mode == "rgb")
        raw = []
        ours = []
        ratios = []
        for _ in range(args.repeats):
            r = steps * args.num_envs / _raw(env, steps, mode == "rgb")
            a = steps * args.num_envs / _adapter(env, steps)
            raw.append(r)
            ours.append(a)
            ratios.append(a / r)
        print(
            f"| mujoco | {args.task} | {mode} | {args.num_envs} | in process | "
            f"{statistics.median(raw):.0f} | {statistics.median(ours):.0f} | "
            f"{statistics.median(ratios):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
