"""Host synchronisations per rollout step on physx_cuda, counted by torch's sync debug mode.

Side by side in one run: the raw environment (random actions, the same task, controller and
number of environments), then our rollout loop (MLP policy, collect()) within episodes and over
whole episodes, and the PPO update. ``--env maniskill`` is ManiSkill's physx_cuda (it needs
SAPIEN's PhysX GPU library); ``--env scripted`` is the tests' scripted environment on the GPU
(tests/scripted_envs.py: its steps are a few tensor ops, so every sync counted is our loop's).
Each row counts the CUDA calls torch reports as synchronising (``set_sync_debug_mode``),
per environment step, split into steps where an episode ended (the environment resets those on
the host) and steps where none did.

    python benchmarks/host_syncs.py [--env maniskill|scripted] [--task PushCube-v1]
        [--num-envs 1024] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch


def counted(fn):
    """(fn's result, where its host syncs happened: "file:line" -> count). Torch's sync debug
    mode warns from the innermost Python frame, which may be torch's own; each sync is counted
    at the innermost frame outside torch instead: the line that called into it. Warp's own
    waits are counted too (``warp_waits_counted``)."""
    sites: Counter[str] = Counter()

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[site_of(traceback.extract_stack()[:-1], filename, lineno)] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warp_waits_counted(sites):
                out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sites


WARP_WAITS = ("synchronize", "synchronize_device", "synchronize_stream", "synchronize_event")


@contextmanager
def warp_waits_counted(sites: Counter[str]):
    """Count Warp's own waits on the device into ``sites``, which torch's debug mode never sees
    (Warp calls CUDA itself): each call of Warp's synchronize functions, at the innermost line
    outside Warp, MuJoCo Warp and torch. Outside a captured graph MuJoCo Warp's solver loop
    waits once an iteration (``wp.capture_while``): what the warp env's graphs avoid."""
    warp = sys.modules.get("warp")
    if warp is None:  # (nothing in this process uses Warp)
        yield
        return
    packages = [warp, sys.modules.get("mujoco_warp")]
    skipped = tuple(Path(m.__file__).resolve().parent for m in packages if m is not None)
    originals = {name: getattr(warp, name) for name in WARP_WAITS}

    def counting(original):
        def wait(*args, **kwargs):
            sites[site_of(traceback.extract_stack()[:-1], "warp", 0, skipped=skipped)] += 1
            return original(*args, **kwargs)

        return wait

    for name, original in originals.items():
        setattr(warp, name, counting(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(warp, name, original)


TORCH_DIR = Path(torch.__file__).resolve().parent


def site_of(
    stack: list[traceback.FrameSummary],
    filename: str,
    lineno: int,
    torch_dir: Path = TORCH_DIR,
    skipped: tuple[Path, ...] = (),
) -> str:
    """ "file:line" of the innermost frame of ``stack`` outside torch's package (``torch_dir``),
    the ``skipped`` folders and the warnings module, else the warning's own ``filename:lineno``.
    (By torch's folder, not by a folder named torch: the GPU image keeps every package under
    /opt/torch/.venv.)"""
    for frame in reversed(stack):
        path = Path(frame.filename)
        inside = any(path.is_relative_to(folder) for folder in (torch_dir, *skipped))
        if not inside and path.name != "warnings.py":
            return f"{path.name}:{frame.lineno}"
    return f"{Path(filename).name}:{lineno}"


def sites_text(sites: Counter[str]) -> str:
    """Like "warp_env.py:357 x2, rollout.py:452" (the most frequent first), or "none"."""
    parts = [site if n == 1 else f"{site} x{n}" for site, n in sites.most_common()]
    return ", ".join(parts) or "none"


def make_env(kind: str, task: str, num_envs: int, episode: int):
    if kind == "scripted":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from scripted_envs import ScriptedEnv

        return ScriptedEnv([0] * num_envs, max_episode_steps=episode, device="cuda")
    from embodied.simulators.maniskill import ManiSkillConfig, ManiSkillEnv

    cfg = ManiSkillConfig(
        task=task,
        backend="gpu",
        num_envs=num_envs,
        control_mode="pd_joint_delta_pos",
        ignore_terminations=True,
        max_episode_steps=episode,
    )
    return ManiSkillEnv(cfg)


def raw(env, steps: int) -> dict:
    """The environment alone: random actions in its bounds, no policy, no bookkeeping."""
    low, high = env.spec.action.bounds(env.device)
    env.reset(seed=0)

    def run():
        for _ in range(steps):
            env.step(low + torch.rand(env.num_envs, len(low), device=env.device) * (high - low))

    _, sites = counted(run)
    return {"loop": "raw environment steps", "steps": steps, **_syncs(sites)}


def ours(env, steps: int, episode: int) -> list[dict]:
    from embodied.algorithm import update
    from embodied.env_group import EnvGroup
    from embodied.episode_stats import EpisodeStats
    from embodied.inference import InferencePolicy
    from embodied.learner import TorchEngine
    from embodied.models import ActorCritic, ActorCriticConfig
    from embodied.ppo import PPO, PPOConfig
    from embodied.rollout import CollectPlan, collect

    num_envs = env.num_envs
    envs = EnvGroup(env)
    policy = ActorCritic(env.spec, ActorCriticConfig()).to(env.device)
    inference = InferencePolicy(policy)
    rows = []
    for label, chunks in (("within episodes", episode - 1), ("whole episodes", steps)):
        plan = CollectPlan(
            seeds=0,
            group_of_env=torch.full((num_envs,), -1),
            num_chunks=chunks,
            episode_base=0,
        )
        stats = EpisodeStats(envs.task_names, env.device)
        collect(envs, inference, envs.reset(seed=0), plan, stats)  # warm-up
        obs = envs.reset(seed=0)
        (batch, _), sites = counted(partial(collect, envs, inference, obs, plan, stats))
        ended = ((batch.terminated | batch.truncated) & batch.valid).any(-1).any(-1)
        rows.append(
            {
                "loop": f"our rollout, {label}",
                "steps": chunks,
                "steps_with_ends": int(ended.sum()),
                **_syncs(sites),
            }
        )
    algo = PPO(PPOConfig(), seed=0, num_envs=num_envs)
    algo.advantages(batch)
    samples = batch.samples()
    learner = TorchEngine(policy, learning_rate=3e-4, max_grad_norm=0.5)
    epochs = 4
    run = partial(update, learner, algo, samples, epochs=epochs, num_minibatches=4)
    _, sites = counted(run)
    loop = "PPO update (4 epochs x 4 minibatches)"
    rows.append({"loop": loop, "epochs": epochs, **_syncs(sites)})
    return rows


def _syncs(sites: Counter[str]) -> dict:
    return {"syncs": sum(sites.values()), "sync_sites": dict(sites)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", choices=["maniskill", "scripted"], default="maniskill")
    p.add_argument("--task", default="PushCube-v1")
    p.add_argument("--num-envs", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--episode", type=int, default=50)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    env = make_env(args.env, args.task, args.num_envs, args.episode)
    rows = [raw(env, args.steps)]
    rows += ours(env, args.steps, args.episode)
    env.close()
    device = torch.cuda.get_device_name()
    name = args.task if args.env == "maniskill" else "scripted env"
    print(f"# {device}, torch {torch.__version__}, {name}, {args.num_envs} envs")
    print("| loop | steps | steps with an episode end | host syncs | per step |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        n = r.get("steps") or r.get("epochs")
        print(
            f"| {r['loop']} | {n} | {r.get('steps_with_ends', '-')} | {r['syncs']} | "
            f"{r['syncs'] / n:.2f} |"
        )
    for r in rows:
        print(f"- {r['loop']}: {sites_text(Counter(r['sync_sites']))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
