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

import hashlib
import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from embodied.schema import EnvSpec, Observation

log = logging.getLogger(__name__)


class DeployError(ValueError):
    pass


def load_deployable(checkpoint: str | Path):
    """(policy in eval mode, its EnvSpec, contract dict, the config it was trained with) of a
    checkpoint."""
    from embodied.checkpoint import resolve_checkpoint
    from embodied.demos import load_policy

    path = resolve_checkpoint(checkpoint)
    policy, train_cfg = load_policy(path)
    spec = EnvSpec.from_dict(json.loads((path / "meta.json").read_text())["spec"])
    return policy, spec, contract(spec, path), train_cfg


def contract(spec: EnvSpec, path: Path) -> dict:
    """What client and server must agree on. Normalization statistics live in the weights file, so
    its digest versions them (with the TP shards' files of a megatron checkpoint); frozen weights
    live in a file named by a digest of its content (meta.json's "frozen"), so that name
    versions them."""
    weights = hashlib.sha1((path / "model.safetensors").read_bytes())
    for file in sorted(path.glob("model-tp*.safetensors")):  # (their weights, not Adam's state)
        shard = load_file(str(file))
        for name in sorted(k for k in shard if k.startswith("weight/")):
            weights.update(name.encode())
            weights.update(shard[name].contiguous().view(-1).view(torch.uint8).numpy())
    frozen = json.loads((path / "meta.json").read_text()).get("frozen")
    if frozen:  # older checkpoints, and models with nothing frozen, have none
        weights.update(frozen.encode())
    agreed = {
        "action": spec.to_dict()["action"],
        "state_names": list(spec.obs.state_names),
        "cameras": [[c.name, c.height, c.width] for c in spec.obs.cameras],
        "weights": weights.hexdigest()[:16],
    }
    return json.loads(json.dumps(agreed))  # lists, not tuples: as it arrives through msgpack


GOAL = "goal_pos"  # the one privileged input an arm can have: a goal its user gives


def check_fits(policy, spec: EnvSpec, cameras, *, known: frozenset[str] = frozenset()) -> None:
    """Refuse a checkpoint that cannot act on an arm with these cameras (names) and these
    privileged inputs (``known``: a goal its user gives; on the twin whatever its simulator
    knows), naming every reason; it needs nothing connected, so it runs before anything is."""
    from embodied.robots.arm import JOINTS, STATE_NAMES

    problems = []
    if tuple(spec.action.names) != JOINTS:
        problems.append(f"actions {spec.action.names}, the arm has {JOINTS}")
    if spec.action.space not in ("joint_pos", "joint_delta"):
        problems.append(
            f"action space {spec.action.space!r} (the arm takes joint_pos or joint_delta)"
        )
    missing = [n for n in spec.obs.state_names if n not in STATE_NAMES]
    if missing:
        problems.append(f"state columns {missing} that the arm does not measure")
    need = set(privileged_inputs(policy, spec))
    unknown = need - known - {GOAL}
    if unknown:
        problems.append(
            f"simulator-only inputs {sorted(unknown)} (train with "
            f"policy.use_privileged=false, or policy.privileged_keys=[{GOAL}])"
        )
    if GOAL in need and GOAL not in known:
        problems.append(f"the input {GOAL} (give --goal X,Y,Z: metres in the arm's base frame)")
    lacking = [c.name for c in spec.obs.cameras if c.name not in set(cameras)]
    if lacking:
        problems.append(f"cameras {lacking} (give --camera NAME=SOURCE for each)")
    if problems:
        raise DeployError("the checkpoint cannot drive this arm: " + "; ".join(problems))


def privileged_inputs(policy, spec: EnvSpec) -> tuple[str, ...]:
    """The privileged keys the policy reads (all of its spec's where it does not say)."""
    return tuple(getattr(policy, "privileged_inputs", tuple(spec.obs.privileged)))


def obs_to_wire(obs: Observation) -> dict:
    return {
        "state": obs.state[0].numpy(),
        "images": {k: v[0].numpy() for k, v in obs.images.items()},
        "instruction": obs.instruction[0],
        "privileged": {k: v[0].numpy() for k, v in obs.privileged.items()},  # a given goal
    }


def wire_to_obs(msg: dict, spec: EnvSpec) -> Observation:
    """A client's observation as a batch of one in the policy's column order."""
    # np.array copies: arrays decoded from msgpack are read-only views of the message
    state = torch.from_numpy(np.array(msg["state"], np.float32))[None]  # f32 [1, S]
    images = {
        k: torch.from_numpy(np.array(v, np.uint8))[None]
        for k, v in (msg.get("images") or {}).items()
    }
    if state.shape[1] != spec.obs.state_dim or set(images) != {c.name for c in spec.obs.cameras}:
        raise ValueError(
            f"observation has {state.shape[1]} state columns and cameras {sorted(images)}; "
            f"the policy needs {spec.obs.state_dim} and {[c.name for c in spec.obs.cameras]}"
        )
    privileged = {
        k: torch.from_numpy(np.array(v, np.float32))[None]
        for k, v in (msg.get("privileged") or {}).items()
    }  # f32 [1, D] each
    return Observation(
        state=state,
        instruction=[str(msg.get("instruction", ""))],
        images=images,
        privileged=privileged,
    )


def policy_chunk(policy, obs: Observation) -> np.ndarray:
    """float32 [K, A] in the policy's own action space."""
    with torch.no_grad():
        return policy.act(obs, deterministic=True).actions[0].float().numpy()


def _select_columns(obs: Observation, spec: EnvSpec, robot_spec: EnvSpec) -> Observation:
    cols = [robot_spec.obs.state_names.index(n) for n in spec.obs.state_names]
    return Observation(
        state=obs.state[:, cols],
        instruction=obs.instruction,
        images={c.name: obs.images[c.name] for c in spec.obs.cameras},
        privileged=dict(obs.privileged),
    )


def robot_infer(chunk_of, spec: EnvSpec, env):
    """obs -> float64 [K, 6] joint targets (radians, the policy's frame) for the control loop: the
    policy's chunk, with deltas (joint_delta) accumulated from the last command the arm was sent."""

    def infer(obs: Observation) -> np.ndarray:
        base = env.to_policy(env.safety.last)  # read before inference: the chunk starts from here
        chunk = np.asarray(chunk_of(_select_columns(obs, spec, env.spec)), np.float64)
        return base + np.cumsum(chunk, 0) if spec.action.space == "joint_delta" else chunk

    return infer


@dataclass
class EpisodeRecorder:
    """Each episode written as a complete LeRobot dataset (``episode_NNNN/``) plus an mp4 per
    camera, as soon as it ends: a crash loses at most the episode in progress."""

    root: Path
    fps: float
    spec: EnvSpec
    robot_type: str
    count: int = 0

    def finish(self, result) -> Path | None:
        """Write the frames of an ended episode (robots.control.EpisodeResult)."""
        from embodied.dataset import LeRobotWriter
        from embodied.video import write_mp4

        frames = result.frames
        if not frames:
            return None
        out = self.root / f"episode_{self.count:04d}"
        self.count += 1
        cams = {c.name: (c.height, c.width) for c in self.spec.obs.cameras}
        writer = LeRobotWriter(
            out,
            fps=self.fps,
            cameras=cams,
            state_names=list(self.spec.obs.state_names),
            action_names=list(self.spec.action.names),
            robot_type=self.robot_type,
            source={"deploy": True},
        )
        T = len(frames)
        images = {c: np.stack([f["obs"].images[c][0].numpy() for f in frames]) for c in cams}
        t0 = frames[0]["t"]
        writer.add_episode(
            images=images,
            state=np.stack([f["obs"].state[0].numpy() for f in frames]),
            actions=np.stack([np.asarray(f["sent"], np.float32) for f in frames]),
            rewards=np.zeros(T, np.float32),
            success=np.zeros(T, bool),
            task=frames[0]["obs"].instruction[0],
            extra={
                "end": result.reason,
                "wall_time_s": [round(f["t"] - t0, 4) for f in frames],
                "interventions": [",".join(f["interventions"]) for f in frames],
                "jitter_p99_ms": result.timing.get("jitter_p99_ms"),
            },
        )
        writer.close()
        for c, video in images.items():
            write_mp4(out / f"{c}.mp4", list(video), self.fps)
        return out


def serve(checkpoint: str, *, host: str = "0.0.0.0", port: int = 8765, queue_size: int = 8):
    """A started PolicyServer for the checkpoint (``.stop()`` ends it)."""
    from embodied.robots.server import PolicyServer

    policy, spec, agreed, _ = load_deployable(checkpoint)
    return PolicyServer(
        lambda msg: policy_chunk(policy, wire_to_obs(msg, spec)),
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
    ``seed + episode`` (a given goal replaces the drawn one); a real arm gets the given goal."""
    given = None if goal is None else np.asarray(goal, np.float64)
    if not twin or train_cfg.env.simulator != "mujoco":
        return [Scene(given) for _ in range(episodes)]
    from embodied.simulators.mujoco.streams import Streams
    from embodied.simulators.mujoco.tasks import TASKS
    from embodied.simulators.mujoco.worlds import draw_initial, reseed

    streams = Streams(episodes, torch.device("cpu"))
    reseed(streams, [seed + e for e in range(episodes)], list(range(episodes)))
    drawn = draw_initial(streams, TASKS[train_cfg.env.task], torch.arange(episodes), 0.0)
    cubes = None if drawn.cube is None else drawn.cube.double().numpy()
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
    episode_seconds: float = 30.0,
    server: str | None = None,
    episodes: int = 1,
    record: str | None = None,
    request_when_left: int = 2,
    blend_steps: int = 2,
    keyboard: bool | None = None,
    goal: tuple[float, float, float] | None = None,
    seed: int = 0,
) -> dict:
    """Deploy ``checkpoint`` on the arm of ``arm`` (ArmConfig) for ``episodes`` episodes of
    ``episode_seconds``, at ``hz`` (None: the rate the policy was trained at). Each episode starts
    at the policy's start pose (MuJoCo-trained policies); on the twin the task's scene is set up
    for it and its success judged."""
    from embodied.robots.control import ChunkExecutor, SafeShutdown

    twin = arm.robot.endswith("-sim")
    if twin:  # (before a large checkpoint is read)
        from embodied.twin import twin_views

        twin_views(arm)
    policy, spec, agreed, train_cfg = load_deployable(checkpoint)
    _fit_rate(arm, spec, hz, episode_seconds)
    # what can refuse the run does so before the arm is touched: the policy's inputs, the server
    known = frozenset([GOAL] if goal else [])
    if _sim_scene(twin, train_cfg):
        known = frozenset(spec.obs.privileged)
    check_fits(policy, spec, arm.cameras, known=known)
    reads = privileged_inputs(policy, spec)
    scenes = episode_scenes(train_cfg, goal, twin, episodes, seed)
    client = None
    if server:
        from embodied.robots.server import PolicyClient

        client = PolicyClient(server, agreed)
    try:
        scene = Scene(None)  # the episode's, for a goal its user gives (read each step)
        env, sim = _robot_env(arm, train_cfg, spec, reads, scene, twin=twin)
        # safe pose, torque off there, disconnect: always, and a bus error in a step stays the
        # error reported (the shutdown's own failures are noted on it)
        with SafeShutdown(env, hz=arm.control_hz) as shutdown:
            new_executor = partial(
                ChunkExecutor,
                robot_infer(_chunk_source(policy, client), spec, env),
                request_when_left=request_when_left,
                blend_steps=blend_steps,
                wait_s=0.5 / arm.control_hz,  # up to half a period for a late chunk
            )
            recorder = None
            if record:
                recorder = EpisodeRecorder(Path(record), arm.control_hz, env.spec, arm.robot)
            start = start_pose(train_cfg)
            episode_summaries = _run_episodes(
                env, sim, arm, scenes, scene, start, new_executor, recorder, keyboard
            )
    finally:
        if client is not None:
            client.close()
    return _summary(episode_summaries, arm, env, shutdown)


def _chunk_source(policy, client):
    """obs -> the next chunk: from the policy server where there is one, else from ``policy``."""
    if client is not None:
        return lambda obs: client.infer(obs_to_wire(obs))
    return lambda obs: policy_chunk(policy, obs)


def _summary(episodes: list[dict], arm, env, shutdown) -> dict:
    """What the deploy reports: each episode, the rate, the task's success where the twin judges
    it, the safety layer's interventions and whether the torque went off at the safe pose."""
    summary = {"episodes": episodes, "robot": arm.robot, "hz": arm.control_hz}
    if env.judge is not None:
        summary["success_rate"] = sum(e["success"] for e in episodes) / len(episodes)
    summary["interventions"] = dict(env.safety.counts)
    summary["torque_off_at_safe_pose"] = shutdown.torque_off
    return summary


def _sim_scene(twin: bool, train_cfg) -> bool:
    """Whether the twin sets the task's scene (and so knows every input the policy reads)."""
    return twin and train_cfg.env.simulator == "mujoco"


def _robot_env(arm, train_cfg, spec: EnvSpec, reads: tuple[str, ...], scene: Scene, *, twin: bool):
    """The arm (``twin``: the twin's, which judges a MuJoCo task), connected, behind its safety
    layer, as a RobotEnv; and the twin's simulator (None on a real arm)."""
    from embodied.robots.arm import RobotEnv, connect, default_safety, make_robot
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
    safety = SafetyLayer(default_safety(robot, arm))
    shapes = {k: spec.obs.privileged[k] for k in reads}

    def given_goal() -> dict[str, np.ndarray]:
        return {GOAL: scene.goal}

    # on the twin its simulator knows every input; a real arm knows the goal it was given
    read = partial(sim.readings, reads) if _sim_scene(twin, train_cfg) else given_goal
    env = RobotEnv(robot, arm, safety, privileged=shapes, read_privileged=read, judge=judge)
    return env, sim


def _run_episodes(
    env, sim, arm, scenes: list[Scene], scene: Scene, start, new_executor, recorder, keyboard
) -> list[dict]:
    """An episode per scene, each from the start pose, until one ends other than by its clock
    (a stop, a fault): their summaries. ``scene`` takes each episode's goal for the policy."""
    from embodied.robots.control import EmergencyStop

    episode_summaries = []
    with EmergencyStop(keyboard=keyboard) as stop:
        for ep, episode_scene in enumerate(scenes):
            scene.goal = episode_scene.goal
            if not _begin(env, sim, episode_scene, start, arm.control_hz):
                raise DeployError(f"episode {ep}: the arm did not reach its start pose")
            executor = new_executor()
            result = _episode(env, executor, stop, arm)
            saved = recorder.finish(result) if recorder else None
            judged = env.judge is not None
            episode_summaries.append(
                _episode_summary(result, executor, saved, episode_scene, judged=judged)
            )
            log.info("episode %d: %d steps, ended by %s", ep, result.steps, result.reason)
            if result.reason != "done":
                break
    return episode_summaries


def _fit_rate(arm, spec: EnvSpec, hz: float | None, episode_seconds: float) -> None:
    """The arm's control rate, episode length and camera size from the policy's."""
    trained_hz = spec.action.control_hz
    if hz is not None and spec.action.space == "joint_delta" and abs(hz - trained_hz) > 1e-6:
        raise DeployError(
            f"--hz {hz:g}: the policy was trained at {trained_hz:g} Hz and acts in joint deltas "
            "per step, so another rate changes how fast it moves; "
            f"leave --hz out to run at {trained_hz:g} Hz"
        )
    arm.control_hz = hz or trained_hz
    arm.max_episode_steps = max(1, round(episode_seconds * arm.control_hz))
    sizes = {(c.height, c.width) for c in spec.obs.cameras}
    if len(sizes) > 1 or any(h != w for h, w in sizes):
        raise DeployError(f"the policy's cameras {spec.obs.cameras} are not one square size")
    if sizes:
        arm.image_size = next(iter(sizes))[0]
    arm.validate()


def _begin(env, sim, scene: Scene, start: np.ndarray | None, hz: float) -> bool:
    """Before an episode: the arm to the start pose (rate-limited, through the safety layer),
    then the twin's scene; the goal the policy is given. Whether the arm got there."""
    from embodied.robots.control import ShutdownReport, move_to_pose

    if start is not None:
        report = ShutdownReport()
        arrived = move_to_pose(
            env,
            env.to_arm(start),
            report,
            hz=hz,
            timeout_s=10.0,
            tolerance=0.05,
            clock=env.clock,
            what="move to the start pose",
        )
        report.raise_first()
        if not arrived:
            return False
    if sim is not None and scene.goal is not None:
        sim.place(scene.goal, scene.cube)
    return True


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
