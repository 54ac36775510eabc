"""Simulation throughput: the raw simulator against our collect phase, side by side in one run.

``--sim mujoco_warp`` is the MuJoCo Warp backend on ``--device`` (cuda, or Warp's CPU device);
``--sim mujoco_rollout`` is ``mujoco.rollout`` on the CPU. For each number of worlds:

- raw: the simulator alone, random servo targets held for each control step (its substeps; on a
  GPU one captured CUDA graph), plus the cameras' rendering for ``--obs rgb``; no observation,
  reward, reset or policy (``env.simulate``);
- replay (MuJoCo Warp): the simulator alone under ours' own commands, recorded in an untimed run
  of ours (the servo targets of each step, every world's state after each reset), plus the
  cameras for rgb. Ours asks the physics for more than raw's random targets do (more solver
  iterations, benchmarks/command_replay.py): ours/replay is what the rest of ours costs;
- ours: the runner's collect phase (``embodied.rollout.collect``): env step (observations, reward,
  success, automatic resets), the MLP actor-critic's inference and the rollout buffers, over
  whole episodes;
- with ``--compile``, ours again with the policy's act through torch.compile
  (``policy.compile_act``) and, on MuJoCo Warp, the env step's reading of the new state too
  (``env.compile``, an env of its own): fused kernels, fewer launches a step, in its own column;
- on CUDA, the host synchronisations per step of ours and compiled
  (``torch.cuda.set_sync_debug_mode``), and the lines that made them;
- with ``--profile``, the torch operators and (on CUDA) the kernels of one step of each, and
  their time (benchmarks/kernel_profile.py).

Throughput is world-steps per second (control steps x worlds), the median of ``--repeats``
rounds in which the loops take turns (on the H100 one run's raw rate differed from another's by 5%
at the same size); a ratio is the median of the rounds' own ratios (each round's loops ran side by
side), with their range. The goal (issue 32): ours/raw at least 0.95 for state at 4096 worlds and
more.

    python benchmarks/gpu_throughput.py --sim mujoco_warp --device cuda --worlds 1024,4096,16384 \
        --compile
    python benchmarks/gpu_throughput.py --sim mujoco_warp --device cuda --obs rgb --worlds 256,1024
    python benchmarks/gpu_throughput.py --sim mujoco_warp --device cpu --worlds 32   # here
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import command_replay  # noqa: E402
from host_syncs import counted, sites_text  # noqa: E402
from kernel_profile import StepProfile, profile_text, profiled  # noqa: E402
from turns import take_turns  # noqa: E402


def make_env(
    sim: str, task: str, worlds: int, device: str, obs: str, size: int, compile_step=False
):
    """The env to measure; ``compile_step``: MuJoCo Warp's step through torch.compile
    (env.compile)."""
    from embodied.simulators.mujoco import MuJoCoConfig, make_env

    cfg = MuJoCoConfig(
        task=task,
        num_envs=worlds,
        backend="warp" if sim == "mujoco_warp" else "rollout",
        device=device if sim == "mujoco_warp" else "cpu",
        obs_mode=obs,
        image_size=size,
        compile=compile_step,
    )
    return make_env(cfg)


def wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Loop:
    """A loop to time: ``prepare()`` outside the clock, then ``run(n)`` for n steps."""

    prepare: Callable[[], None]
    run: Callable[[int], None]


def raw_loop(env) -> Loop:
    """The simulator alone (and its cameras with rgb), warmed up; it runs on from where it is."""
    from embodied.simulators.mujoco.worlds import HIGH, LOW

    low = torch.tensor(LOW, device=env.device)
    high = torch.tensor(HIGH, device=env.device)
    cameras = bool(env.spec.obs.cameras)
    env.reset(seed=0)

    def run(n: int) -> None:
        for _ in range(n):
            env.simulate(low + torch.rand(env.num_envs, len(low), device=env.device) * (high - low))
            if cameras:
                env._images()  # the rendering an rgb observation costs

    run(2)  # warm-up: kernels loaded, the CUDA graph captured
    return Loop(prepare=lambda: None, run=run)


def replay_loop(env, ours: Loop, steps: int) -> Loop:
    """The simulator alone under ours' own commands (MuJoCo Warp): the servo targets and
    resets of one untimed run of ``ours``, replayed from its starting state
    (benchmarks/command_replay.py). The physics is that of ours' trajectory: bit for bit on
    Warp's CPU device; on a GPU, where contact rows are allocated by atomics, the same work."""
    recorded = command_replay.record(env, ours.prepare, ours.run, steps)
    render = bool(env.spec.obs.cameras)
    return Loop(
        prepare=lambda: command_replay.restore(env, recorded.start),
        run=lambda n: command_replay.replay(env, recorded, n, render),
    )


def ours_loop(env, compile_act: bool = False) -> Loop:
    """The collect phase, warmed up; each run starts from fresh episodes, reset beforehand.
    ``compile_act``: the policy's act through torch.compile (compiled in the warm-up)."""
    from embodied.env_group import EnvGroup
    from embodied.episode_stats import EpisodeStats
    from embodied.inference import InferencePolicy
    from embodied.models import ActorCritic, ActorCriticConfig
    from embodied.rollout import CollectPlan, collect

    envs = EnvGroup(env)
    policy = ActorCritic(env.spec, ActorCriticConfig()).to(env.device)
    inference = InferencePolicy(policy, compile_act=compile_act)
    group_of_env = torch.full((env.num_envs,), -1)
    stats = EpisodeStats(envs.task_names, env.device)
    first_obs = []

    def prepare() -> None:
        first_obs[:] = [envs.reset(seed=0)]

    def run(n: int) -> None:
        plan = CollectPlan(seeds=0, group_of_env=group_of_env, num_chunks=n, episode_base=0)
        collect(envs, inference, first_obs[0], plan, stats)

    prepare()
    run(2)
    return Loop(prepare=prepare, run=run)


def rate(env, loop: Loop, steps: int) -> float:
    """World-steps/s of ``steps`` steps of ``loop``."""
    loop.prepare()
    wait(env.device)
    start = time.perf_counter()
    loop.run(steps)
    wait(env.device)
    return steps * env.num_envs / (time.perf_counter() - start)


@dataclass
class Measured:
    raw: float  # world-steps/s, the median of the repeats
    ours: float
    compiled: float | None  # ours with the act (and MuJoCo Warp's step) compiled (--compile)
    replay: float | None  # the simulator alone under ours' commands (MuJoCo Warp)
    sites: dict[str, Counter[str]]  # on CUDA: loop (ours, compiled) -> its host syncs by line
    profile: dict[str, StepProfile]  # loop ("raw", "ours", ...) -> its profile, with --profile
    rates_per_round: dict[str, list[float]]  # loop -> its world-steps/s in each round

    def per_round(self, label: str, base: str) -> list[float]:
        """label's rate over base's in each round (paired: the loops took turns within it);
        [] where either loop has no rounds."""
        rates, bases = self.rates_per_round.get(label), self.rates_per_round.get(base)
        if not rates or not bases:
            return []
        return [rate / base_rate for rate, base_rate in zip(rates, bases, strict=True)]

    def ratio(self, label: str, base: str) -> float | None:
        """The median of the per-round ratios; None where either loop has no rounds."""
        rounds = self.per_round(label, base)
        return statistics.median(rounds) if rounds else None


OPTIONAL = ("replay", "compiled")  # loops that may fail without costing the others' numbers


def drop(label: str, what: str, worlds: int, error: Exception) -> None:
    """An optional loop's failure, said on stderr (its cells show "-"); any other's, raised."""
    if label not in OPTIONAL:
        raise error
    print(f"{label} {what} at {worlds} worlds: {error!r}", file=sys.stderr)


def interleaved(env, loops: dict[str, Loop], steps: int, repeats: int) -> dict[str, list[float]]:
    """Each loop's world-steps/s in each of ``repeats`` rounds, taking turns (turns.take_turns).
    A replay (an instrument of its own) or a compiled loop (inductor's code) that fails is
    dropped, from ``loops`` too, said on stderr (its columns show "-"), so that raw and ours are
    still measured."""

    def dropped(label: str, error: Exception) -> None:
        drop(label, "not measured", env.num_envs, error)
        del loops[label]

    runs = {label: functools.partial(rate, env, loop, steps) for label, loop in loops.items()}
    return take_turns(runs, repeats, dropped=dropped)


def measure(env, steps: int, profile: bool, fused_env, replay: bool, repeats: int = 1) -> Measured:
    """raw and ours (and ours compiled on ``fused_env``, when there is one, and the replay of
    ours' commands) side by side, medians of ``repeats`` interleaved rounds; on CUDA the host
    syncs of ours (and compiled) by line; profiles if asked."""
    loops = {"raw": raw_loop(env), "ours": ours_loop(env)}
    if fused_env is not None:
        try:  # (compiled in its warm-up)
            loops["compiled"] = ours_loop(fused_env, compile_act=True)
        except Exception as error:
            drop("compiled", "not built", env.num_envs, error)
    if replay:
        try:  # recorded from an untimed run of ours
            loops["replay"] = replay_loop(env, loops["ours"], steps)
        except Exception as error:
            drop("replay", "not recorded", env.num_envs, error)
    rates = interleaved(env, loops, steps, repeats)
    median = {label: statistics.median(values) for label, values in rates.items()}
    sites, profiles = syncs_and_profiles(env, loops, steps, profile)
    return Measured(
        median["raw"],
        median["ours"],
        median.get("compiled"),
        median.get("replay"),
        sites,
        profiles,
        rates,
    )


def syncs_and_profiles(env, loops: dict[str, Loop], steps: int, profile: bool) -> tuple:
    """On CUDA the host syncs of ours and compiled, by line (loop -> Counter); each loop's
    profile if asked (loop -> StepProfile). An optional loop that fails here is left out, said
    on stderr. (Only an error raised in Python is survived: a device fault, an illegal address
    in inductor's code, leaves CUDA unusable for the rest of the process.)"""
    sites: dict[str, Counter[str]] = {}
    profiles: dict[str, StepProfile] = {}
    for label, loop in loops.items():
        try:
            if env.device.type == "cuda" and label in ("ours", "compiled"):
                loop.prepare()
                _, sites[label] = counted(lambda loop=loop: loop.run(steps))
            if profile:
                loop.prepare()
                profiles[label] = profiled(lambda loop=loop: loop.run(steps), steps, env.device)
        except Exception as error:
            drop(label, "syncs or profile not taken", env.num_envs, error)
            sites.pop(label, None)
    return sites, profiles


def header(compiled: bool, replay: bool) -> str:
    """The table's two header lines: raw, [replay,] ours and their ratios, [compiled]."""
    names = ["raw world-steps/s"] + ["replay world-steps/s"] * replay
    names += ["ours world-steps/s", "ours/raw"] + ["ours/replay"] * replay
    if compiled:
        names += ["ours compiled world-steps/s", "compiled/raw"] + ["compiled/replay"] * replay
    names.append("host syncs per step")
    if compiled:
        names.append("compiled host syncs per step")
    head = "| sim | device | obs | worlds | " + " | ".join(names) + " |"
    return head + "\n|---|---|---|---:|" + "---:|" * len(names)


def cells(m: Measured, syncs: dict[str, float], compiled: bool, replay: bool) -> str:
    """A row's numbers after its worlds, in ``header``'s order ("-" where one is missing: a
    replay that failed, host syncs off CUDA). syncs: loop -> host syncs per step. A ratio is
    the median of its rounds' ratios, with their range where there are several."""
    texts = [f"{m.raw:,.0f}"] + [_or_dash(m.replay, ",.0f")] * replay
    for label in ["ours"] + ["compiled"] * compiled:
        texts.append(_or_dash(getattr(m, label), ",.0f"))
        texts += [_ratio_text(m, label, base) for base in ["raw"] + ["replay"] * replay]
    texts += [_or_dash(syncs.get(label), ".2f") for label in ["ours"] + ["compiled"] * compiled]
    return " " + " | ".join(texts) + " |"


def _ratio_text(m: Measured, label: str, base: str) -> str:
    rounds = m.per_round(label, base)
    text = _or_dash(m.ratio(label, base), ".2f")
    if len(rounds) > 1:
        text += f" ({min(rounds):.2f}-{max(rounds):.2f})"
    return text


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", choices=["mujoco_warp", "mujoco_rollout"], default="mujoco_warp")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--task", default="push")
    p.add_argument("--obs", choices=["state", "rgb"], default="state")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--worlds", default="1024,4096,16384", help="comma-separated world counts")
    p.add_argument("--steps", type=int, default=100, help="control steps timed per case")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians reported")
    p.add_argument("--json", help="append each row here as it is measured (JSON lines)")
    p.add_argument("--profile", action="store_true", help="kernels and operators per step")
    p.add_argument("--compile", action="store_true", help="ours compiled too (act and step)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats: at least 1, got {args.repeats}")
    torch.set_grad_enabled(False)
    replay = args.sim == "mujoco_warp"
    print(header(args.compile, replay))
    where = []  # the lines that synchronised, printed below the table
    profiles = []  # the same, per step of raw and ours
    for worlds in (int(w) for w in args.worlds.split(",")):
        env_args = (args.sim, args.task, worlds, args.device, args.obs, args.image_size)
        with contextlib.ExitStack() as envs:  # each closed (its buffer check) whatever happens
            env = envs.enter_context(make_env(*env_args))
            fused = None
            if args.compile:
                try:
                    fused = envs.enter_context(make_env(*env_args, args.sim == "mujoco_warp"))
                except Exception as error:
                    drop("compiled", "env not built", worlds, error)
            measured = measure(env, args.steps, args.profile, fused, replay, args.repeats)
        gc.collect()  # (torch.compile's caches refer to the envs: free their device memory now)
        raw_rate, ours_rate, sites = measured.raw, measured.ours, measured.sites
        for label, by_line in sites.items():
            where.append(f"- {worlds} worlds, host syncs of {label} by line: {sites_text(by_line)}")
        for label, step in measured.profile.items():
            profiles.append(profile_text(f"{worlds} worlds, {label}", step))
        syncs = {label: sum(by_line.values()) / args.steps for label, by_line in sites.items()}
        row = {
            "sim": args.sim,
            "device": str(env.device),
            "gpu": torch.cuda.get_device_name() if env.device.type == "cuda" else None,
            "task": args.task,
            "obs": args.obs,
            "image_size": args.image_size if args.obs == "rgb" else None,
            "worlds": worlds,
            "steps": args.steps,
            "rates_per_round": measured.rates_per_round,  # (the medians above)
            "raw_world_steps_per_s": raw_rate,
            "ours_world_steps_per_s": ours_rate,
            "ours_over_raw": measured.ratio("ours", "raw"),  # (the median of the rounds')
            "ours_over_raw_per_round": measured.per_round("ours", "raw"),
            "compiled_world_steps_per_s": measured.compiled,
            "replay_world_steps_per_s": measured.replay,
            "host_syncs_per_step": syncs.get("ours"),
            "compiled_host_syncs_per_step": syncs.get("compiled"),
            "sync_sites": {label: dict(by_line) for label, by_line in sites.items()},
            "profile": {label: asdict(step) for label, step in measured.profile.items()},
        }
        numbers = cells(measured, syncs, args.compile, replay)
        print(f"| {args.sim} | {row['device']} | {args.obs} | {worlds} |{numbers}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    if where:
        print("\n".join(["", *where]))
    if profiles:
        print("\n".join(["", *profiles]))


if __name__ == "__main__":
    main()
