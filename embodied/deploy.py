"""``embodied serve`` and ``embodied deploy``: a trained checkpoint driving a real arm or its twin.

deploy: LeRobot's driver (or the MuJoCo twin for ``--robot so101-sim``) -> ``RobotEnv`` -> the
control loop at ``--hz`` with chunks inferred in the background, in this process or on a policy
server (``--server ws://...``); every command through the safety layer; each episode recorded as
its own LeRobot dataset under ``--record`` (finished episodes survive a crash); on any exit the
arm goes to its safe pose and only there is torque switched off.
serve: the checkpoint's policy behind the websocket server (robots/server.py); a client must
present the same contract (action spec, observation columns, cameras, checkpoint weights).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from embodied.deploy_policy import (
    GOAL,
    DeployError,
    RobotInfer,
    check_fits,
    load_deployable,
    obs_to_wire,
    policy_chunk,
    select_columns,
    serve_device,
    wire_to_obs,
)
from embodied.deploy_record import EpisodeRecorder
from embodied.schema import EnvSpec
from embodied.seeds import check_seed, eval_seed

log = logging.getLogger(__name__)
WARM_UP_S = 60.0  # a served policy's first inference (a cold server: its set-up, compiles)

KOCH_REFUSED = (
    "--robot koch: deploy has the SO-100/SO-101's geometry and rest pose only (its workspace "
    "check and the pose its torque goes off at would be another arm's)"
)


def serve(
    checkpoint: str, *, host: str = "0.0.0.0", port: int = 8765, queue_size: int = 8, device="cpu"
):
    """A started PolicyServer for the checkpoint, its policy on ``device`` (auto: cuda where
    this machine has it; ``.stop()`` ends it)."""
    from embodied.robots.server import PolicyServer

    device = serve_device(str(device))
    policy, spec, agreed, _ = load_deployable(checkpoint, device)
    return PolicyServer(
        lambda msg: policy_chunk(policy, wire_to_obs(msg, spec).to(device)),
        agreed,
        host=host,
        port=port,
        queue_size=queue_size,
    ).start()


@dataclass
class Scene:
    """How an episode starts: the goal the policy is given (f64 [3], metres, base frame, or None)
    and, on the twin, the cube's place (f64 [3] or None)."""

    goal: np.ndarray | None
    cube: np.ndarray | None = None


def episode_scenes(train_cfg, goal, twin: bool, episodes: int, seed: int) -> list[Scene]:
    """One Scene per episode. On the twin the MuJoCo task's own sampler draws goal and cube from
    the held-out seeds: episode e's is ``embodied eval``'s episode e's at ``seed`` (a given goal
    replaces the drawn one, and places the cube where the task's goals are drawn from: under
    it for pick, behind it for push); a real arm gets the given goal."""
    given = None if goal is None else np.asarray(goal, np.float64)
    if train_cfg.env.simulator != "mujoco":
        return [Scene(given) for _ in range(episodes)]
    from embodied.simulators.mujoco.streams import Streams
    from embodied.simulators.mujoco.tasks import TASKS
    from embodied.simulators.mujoco.worlds import draw_initial, reseed

    task = TASKS[train_cfg.env.task]
    sizes = 0.0 if twin else train_cfg.env.randomize.cube_size  # (the twin's cube: as written)
    try:
        under = None if given is None else task.cube_under(tuple(given.tolist()), sizes)
    except ValueError as e:
        raise DeployError(f"--goal: {e}") from None
    if not twin:
        return [Scene(given) for _ in range(episodes)]
    streams = Streams(episodes, torch.device("cpu"))
    first = eval_seed(seed, held_out=True)
    reseed(streams, [first + e for e in range(episodes)], list(range(episodes)))
    drawn = draw_initial(streams, task, torch.arange(episodes), 0.0)
    cubes = None if drawn.cube is None else drawn.cube.double().numpy()
    if under is not None:
        cubes = np.tile(np.asarray(under, np.float64), (episodes, 1))  # f64 [E, 3]
    return [
        Scene(
            drawn.goal[e].double().numpy() if given is None else given,
            None if cubes is None else cubes[e],
        )
        for e in range(episodes)
    ]


def start_pose(train_cfg) -> np.ndarray | None:
    """Where episodes of a MuJoCo-trained policy begin (radians [6], the policy's frame): the
    SO-101's home pose its training started from; None for other simulators."""
    if train_cfg.env.simulator != "mujoco":
        return None
    from embodied.simulators.mujoco.worlds import HOME_POSE

    return np.asarray(HOME_POSE, np.float64)


def run_deploy(
    checkpoint: str,
    arm,
    *,
    hz: float | None = None,
    episode_seconds: float | None = None,
    server: str | None = None,
    episodes: int = 1,
    record: str | None = None,
    request_when_left: int = 2,
    blend_steps: int = 2,
    keyboard: bool | None = None,
    goal: tuple[float, float, float] | None = None,
    seed: int = 0,
    device: str = "auto",
) -> dict:
    """Deploy ``checkpoint`` on the arm of ``arm`` (ArmConfig) for ``episodes`` episodes of
    ``episode_seconds`` (None: as long as its training's), at ``hz`` (None: the rate the policy
    was trained at). Each episode starts
    at the policy's start pose (MuJoCo-trained policies); on the twin the task's scene is set up
    for it and its success judged. ``device``: where a policy in this process runs (as
    ``serve``'s: auto is cuda where the machine has it)."""
    from embodied.robots.control import ChunkExecutor, EmergencyStop
    from embodied.robots.shutdown import SafeShutdown

    check_seed("--seed", seed)
    if arm.robot.startswith("koch"):  # (read-arm and the driver's contract take it)
        raise DeployError(KOCH_REFUSED)
    twin = arm.robot.endswith("-sim")
    if twin:  # (before a large checkpoint is read)
        from embodied.twin import twin_views

        twin_views(arm)
    device = serve_device(device) if server is None else torch.device("cpu")
    policy, spec, agreed, train_cfg = load_deployable(checkpoint, device, build=server is None)
    _fit_arm(arm, spec, hz, episode_seconds)
    # what can refuse the run does so before the arm is touched: the policy's inputs, the server
    reads = _inputs(spec, arm, train_cfg, goal=goal, twin=twin)
    scenes = episode_scenes(train_cfg, goal, twin, episodes, seed)
    client = _client(server, agreed, arm.watchdog_s)
    episode_summaries = []
    try:
        # the episode's, for a goal its user gives (read at every inference, the warm-up's too)
        scene = Scene(scenes[0].goal)
        env, sim = _robot_env(arm, train_cfg, spec, reads, scene, twin=twin)
        chunk_of = _chunk_source(policy, client, device=device)
        # safe pose, torque off there, disconnect: always, and a bus error in a step stays the
        # error reported (the shutdown's own failures are noted on it). The stop's signal
        # handlers outlast the shutdown: a second Ctrl-C or a SIGTERM cannot cut it short.
        with EmergencyStop(keyboard=keyboard) as stop, SafeShutdown(env, hz=arm.control_hz) as sd:
            _warm_up(_chunk_source(policy, client, WARM_UP_S, device), spec, env)
            infer = RobotInfer(chunk_of, spec, env)
            new_executor = partial(
                ChunkExecutor,
                infer,
                prepare=infer.prepare,
                command=infer.command,
                request_when_left=request_when_left,
                blend_steps=blend_steps,
                wait_s=0.5 / arm.control_hz,  # up to half a period for a late chunk
            )
            recorder = _recorder(record, arm, env)
            start = start_pose(train_cfg)
            episode_summaries = _run_episodes(
                env, sim, arm, scenes, scene, start, new_executor, recorder, stop
            )
    except Exception as e:  # the shutdown's own failure: the episodes it followed are said
        if episode_summaries:
            e.add_note(f"before it: {_so_far(episode_summaries)}")
        raise
    finally:
        if client is not None:
            client.close()
    return _summary(episode_summaries, arm, env, sd, stop)


def _inputs(spec: EnvSpec, arm, train_cfg, *, goal, twin: bool) -> tuple[str, ...]:
    """The privileged inputs the policy reads; refused where the arm cannot give them: a real arm
    knows only a goal its user gives, the twin of a MuJoCo task all its simulator knows."""
    known = frozenset([GOAL] if goal else [])
    if _sim_scene(twin, train_cfg):
        known = frozenset(spec.obs.privileged)
    reads = tuple(sorted(train_cfg.policy.read_privileged(spec)))
    if goal is not None and GOAL not in reads and not _sim_scene(twin, train_cfg):
        raise DeployError(
            "--goal: the policy reads no goal (it was trained without "
            "policy.privileged_keys=[goal_pos]); it would act without it"
        )
    check_fits(reads, spec, arm.cameras, known=known)
    return reads


def _warm_up(chunk_of, spec: EnvSpec, env) -> None:
    """One inference before the first episode, its chunk unused: a policy's first call (lazy
    set-up, a cold server: up to ``WARM_UP_S``) is not charged to the first episode's watchdog.
    An inference that fails here ends the deploy before any episode (the arm then goes to its
    safe pose)."""
    obs = env.observe()
    t0 = time.monotonic()
    try:
        chunk_of(select_columns(obs, spec, env.spec))
    except Exception as e:
        raise DeployError(f"the first inference failed, before the first episode: {e}") from e
    log.info("first inference: %.2f s (before the episodes)", time.monotonic() - t0)


def _recorder(record: str | None, arm, env) -> EpisodeRecorder | None:
    """Where each episode is written as it ends (``--record``), if anywhere."""
    if not record:
        return None
    judged = env.judge is not None
    return EpisodeRecorder(Path(record), arm.control_hz, env.spec, arm.robot, judged=judged)


def _client(server: str | None, agreed: dict, watchdog_s: float):
    """The policy server's client (None without a server), its contract agreed; a request may
    take as long as the watchdog lets the arm wait (``--robot.watchdog``), 2 s at least."""
    if not server:
        return None
    from embodied.robots.server import PolicyClient

    return PolicyClient(server, agreed, timeout_s=max(2.0, watchdog_s))


def _chunk_source(policy, client, timeout_s: float | None = None, device=None):
    """obs -> the next chunk: from the policy server where there is one (a request within
    ``timeout_s``; None: the client's), else from ``policy`` on ``device``."""
    if client is not None:
        return lambda obs: client.infer(obs_to_wire(obs), timeout_s)
    return lambda obs: policy_chunk(policy, obs.to(device))


def _summary(episodes: list[dict], arm, env, shutdown, stop) -> dict:
    """What the deploy reports: each episode, the rate, what stopped it early (the emergency
    stop's reason, or None), the task's success where the twin judges it, the safety layer's
    interventions in episodes and in the moves between them, and whether the torque went off at
    the safe pose. The success rate is over the episodes that ran their clock."""
    summary = {"episodes": episodes, "robot": arm.robot, "hz": arm.control_hz}
    summary["emergency_stop"] = stop.reason if stop.is_set() else None
    completed = [e for e in episodes if e["end"] == "done"]  # a stopped one is in its entry
    if env.judge is not None and completed:
        summary["success_rate"] = sum(e["success"] for e in completed) / len(completed)
        summary["judged_episodes"] = len(completed)
    in_episodes = sum((Counter(e["interventions"]) for e in episodes), Counter())
    summary["interventions"] = dict(in_episodes)
    # the moves to the start and safe poses are rate-limited by the same layer
    summary["interventions_in_moves"] = dict(env.safety.counts - in_episodes)
    summary["torque_off_at_safe_pose"] = shutdown.torque_off
    return summary


def _sim_scene(twin: bool, train_cfg) -> bool:
    """Whether the twin sets the task's scene (and so knows every input the policy reads)."""
    return twin and train_cfg.env.simulator == "mujoco"


def _robot_env(arm, train_cfg, spec: EnvSpec, reads: tuple[str, ...], scene: Scene, *, twin: bool):
    """The arm (``twin``: the twin's, which judges a MuJoCo task), connected, behind its safety
    layer, as a RobotEnv; and the twin's simulator (None on a real arm)."""
    from embodied.robots.arm import RobotEnv, connect, default_safety, make_robot, release
    from embodied.robots.safety import SafetyLayer

    mujoco_task = train_cfg.env.simulator == "mujoco"
    judge = None
    sim = None
    if twin:
        from embodied.twin import make_twin_robot

        robot, sim, _ = make_twin_robot(arm, task=train_cfg.env.task if mujoco_task else "push")
        judge = sim.success if mujoco_task else None
    else:
        robot = make_robot(arm)
    connect(robot, arm)
    try:  # (no SafeShutdown yet: an error here releases the arm, torque off as before connect)
        safety = SafetyLayer(default_safety(robot, arm))
        shapes = {k: spec.obs.privileged[k] for k in reads}

        def given_goal() -> dict[str, np.ndarray]:
            return {GOAL: scene.goal}

        # on the twin its simulator knows every input; a real arm knows the goal it was given
        read = partial(sim.readings, reads) if _sim_scene(twin, train_cfg) else given_goal
        env = RobotEnv(robot, arm, safety, privileged=shapes, read_privileged=read, judge=judge)
    except BaseException as e:
        release(robot, e)
        raise
    return env, sim


def _run_episodes(
    env, sim, arm, scenes: list[Scene], scene: Scene, start, new_executor, recorder, stop
) -> list[dict]:
    """An episode per scene, each from the start pose, until one ends other than by its clock
    (a stop, a fault) or ``stop`` (an EmergencyStop) comes between two: their summaries.
    ``scene`` takes each episode's goal for the policy."""
    episode_summaries = []
    try:
        for ep, episode_scene in enumerate(scenes):
            scene.goal = episode_scene.goal
            began = not stop.is_set() and _begin(env, sim, episode_scene, start, stop, arm)
            if stop.is_set():
                log.warning("emergency stop (%s) before episode %d", stop.reason, ep)
                break
            if not began:
                raise DeployError(f"episode {ep}: the arm did not reach its start pose")
            executor = new_executor()
            before = Counter(env.safety.counts)
            result = _episode(env, executor, stop, arm)
            saved = recorder.finish(result) if recorder else None
            judged = env.judge is not None
            summary = _episode_summary(result, executor, saved, episode_scene, judged=judged)
            summary["interventions"] = dict(env.safety.counts - before)
            episode_summaries.append(summary)
            log.info("episode %d: %s", ep, _so_far([summary]))
            if result.reason != "done":
                break
    except Exception as e:  # (what the episodes before it gave is not lost with the run)
        if episode_summaries:
            e.add_note(f"before it: {_so_far(episode_summaries)}")
        raise
    return episode_summaries


def _so_far(summaries: list[dict]) -> str:
    """Episodes in one phrase: how many, their steps, and their success where it was judged."""
    said = f"{len(summaries)} episode(s) of {sum(s['steps'] for s in summaries)} steps"
    judged = [s["success"] for s in summaries if s.get("success") is not None]
    return said + (f", success in {sum(judged)} of {len(judged)}" if judged else "")


def _fit_arm(arm, spec: EnvSpec, hz: float | None, episode_seconds: float | None) -> None:
    """The arm's control rate, episode length (None: the training's, so that the twin's success
    is eval's), camera size and (unless given) instruction from the policy's."""
    told = list(dict.fromkeys(spec.instructions))  # (a multi-task policy's, each once)
    if not arm.instruction and len(told) > 1:
        raise DeployError(
            f"--instruction: the policy was trained on {len(told)} tasks ({told}); say which"
        )
    if not arm.instruction and told:  # (the task's words, as in training)
        arm.instruction = told[0]
    trained_hz = spec.action.control_hz
    if hz is not None and spec.action.space == "joint_delta" and abs(hz - trained_hz) > 1e-6:
        raise DeployError(
            f"--hz {hz:g}: the policy was trained at {trained_hz:g} Hz and acts in joint deltas "
            "per step, so another rate changes how fast it moves; "
            f"leave --hz out to run at {trained_hz:g} Hz"
        )
    arm.control_hz = hz or trained_hz
    if episode_seconds is None:
        episode_seconds = spec.max_episode_steps / trained_hz
    arm.max_episode_steps = max(1, round(episode_seconds * arm.control_hz))
    sizes = {(c.height, c.width) for c in spec.obs.cameras}
    if len(sizes) > 1 or any(h != w for h, w in sizes):
        raise DeployError(f"the policy's cameras {spec.obs.cameras} are not one square size")
    if sizes:
        arm.image_size = next(iter(sizes))[0]
    arm.validate()


def _begin(env, sim, scene: Scene, start: np.ndarray | None, stop, arm) -> bool:
    """Before an episode: the arm to the start pose (rate-limited, through the safety layer;
    ``stop`` ends the move), then the twin's scene; the goal the policy is given. Whether the arm
    got there."""
    from embodied.robots.shutdown import ShutdownReport, move_to_pose

    if start is not None:
        _check_in_range(env.safety, env.to_arm(start))
        report = ShutdownReport()
        arrived = move_to_pose(
            env,
            env.to_arm(start),
            report,
            hz=arm.control_hz,
            timeout_s=10.0,
            tolerance=0.05,
            clock=env.clock,
            what="move to the start pose",
            stop=stop,
        )
        report.raise_first()
        if not arrived:
            return False
    if sim is not None and scene.goal is not None:
        sim.place(scene.goal, scene.cube)
    return True


def _check_in_range(safety, pose: np.ndarray, tolerance: float = 0.05) -> None:
    """Refuse a start pose (radians [6], the arm's frame) that a joint's range, the calibrated one
    less its margin, keeps the arm from: the move to it would end in a timeout, naming no joint."""
    from embodied.robots.arm import JOINTS

    gap = np.abs(safety.within_limits(pose) - pose)  # f64 [6]
    if gap.max() <= tolerance:
        return
    j = int(gap.argmax())
    raise DeployError(
        f"the start pose's {JOINTS[j]} is {pose[j]:+.2f} rad (the arm's frame), outside the "
        f"arm's range {safety.low[j]:+.2f}..{safety.high[j]:+.2f} rad (its calibration less "
        "the joint margin): calibrate it over its whole travel (lerobot-calibrate), or check "
        "--robot.joint-offsets"
    )


def _episode(env, executor, stop, arm):
    from embodied.robots.control import run_episode

    try:
        return run_episode(env, executor, stop, hz=arm.control_hz, max_steps=arm.max_episode_steps)
    finally:
        executor.close()


def _episode_summary(result, executor, saved, scene: Scene, *, judged: bool) -> dict:
    out = {
        "steps": result.steps,
        "acted": result.acted,
        "end": result.reason,
        **result.timing,
        "watchdog": dict(result.watchdog),
        "inference_errors": executor.errors,
        "recording": str(saved) if saved else None,
    }
    if scene.goal is not None:
        out["goal"] = [round(float(v), 4) for v in scene.goal]
    if judged:  # the twin's simulator says whether the task was done
        out["success"] = result.success
        out["success_at_end"] = bool(result.successes and result.successes[-1])
    return out
