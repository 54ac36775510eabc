"""Environment throughput: raw simulator steps/s vs the same steps through our adapter, side by side.

MuJoCo (this version; ManiSkill's side is benchmarks/rollout_overhead.py, LIBERO is to come):
  raw      the desktop-arm model stepped with ``mujoco.rollout`` for all environments (same
           substeps per control step), random servo targets, sensors read; rgb adds one offscreen
           render per environment per step, as the adapter does
  adapter  ``MuJoCoEnv.step`` with random actions: the same physics plus the contract's work
           (action clipping, observation tensors, reward/success, time limits, auto-reset)
Both run in this process, alternating, several repeats; the median of per-repeat ratios is the
headline (the machine's speed drifts).

    python benchmarks/env_throughput.py [--num-envs 16] [--steps 200] [--repeats 5] [--modes state rgb]
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

    B, nu = env.num_envs, env.model.nu
    env.reset(seed=0)
    state, mocap = env._state.copy(), env._mocap.copy()  # start from the adapter's current states
    renderer = mujoco.Renderer(env.model, env.cfg.image_size, env.cfg.image_size) if rgb else None
    data, scratch = [mujoco.MjData(env.model)], mujoco.MjData(env.model)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    target, low, high = env._target.copy(), env._low, env._high
    for _ in range(steps):  # the same motion as the adapter's: random deltas added to the servo targets
        target = np.clip(target + rng.uniform(-0.1, 0.1, (B, nu)), low, high)
        control = np.concatenate([target, mocap], 1)[:, None]
        states, sensors = rollout.rollout(env.model, data, state, control, control_spec=env._control_spec,
                                          nstep=env._substeps)
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


def main() -> None:
    from embodied.simulators.mujoco import MuJoCoConfig, MuJoCoEnv

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["state", "rgb"])
    ap.add_argument("--task", default="push")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("| simulator | task | obs | envs | raw steps/s | adapter steps/s | ratio (median) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for mode in args.modes:
        steps = args.steps if mode == "state" else max(10, args.steps // 10)
        with MuJoCoEnv(MuJoCoConfig(task=args.task, num_envs=args.num_envs, obs_mode=mode)) as env:
            env.reset(seed=0)
            _adapter(env, 5), _raw(env, 5, mode == "rgb")  # warm-up (renderer contexts, caches)
            raw, ours, ratios = [], [], []
            for _ in range(args.repeats):
                r = steps * args.num_envs / _raw(env, steps, mode == "rgb")
                a = steps * args.num_envs / _adapter(env, steps)
                raw.append(r), ours.append(a), ratios.append(a / r)
            print(f"| mujoco | {args.task} | {mode} | {args.num_envs} | {statistics.median(raw):.0f} | "
                  f"{statistics.median(ours):.0f} | {statistics.median(ratios):.3f} |", flush=True)


if __name__ == "__main__":
    main()
