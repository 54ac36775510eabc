"""``embodied serve`` and ``embodied deploy``: their options, checked before anything connects,
and their entry points (embodied/deploy.py does the work)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from embodied.cli_errors import error as _error


def _cameras(values: list[str]) -> dict[str, str]:
    out = {}
    for v in values or []:
        name, sep, source = v.partition("=")
        if not sep or not name:
            raise ValueError(
                f"--camera {v!r}: expected NAME=SOURCE "
                "(an OpenCV index or device; the twin: front or wrist)"
            )
        if name in out:
            raise ValueError(f"--camera {name}: given twice ({out[name]!r} and {source!r})")
        out[name] = source
    return out


def _floats(option: str, text: str | None, default: float, n: int = 6, what: str = "joint"):
    """``n`` comma-separated numbers (a tuple of floats), ``default`` n times where none given."""
    if not text:
        return (default,) * n
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != n or not all(math.isfinite(v) for v in values):
        raise ValueError(
            f"{option} {text!r}: expected {n} comma-separated finite numbers, one per {what}"
        )
    return values


def _gripper_range(args) -> dict:
    """``--robot.gripper-range CLOSED,OPEN`` as ArmConfig's keyword (none: its default)."""
    if not args.gripper_range:
        return {}
    what = "end (radians at LeRobot's 0 and 100)"
    return {"gripper_range": _floats("--robot.gripper-range", args.gripper_range, 0.0, 2, what)}


def _check_reachable(text: str, goal: tuple[float, float, float]) -> None:
    """A goal outside the box the safety layer keeps the tool point in is refused before the arm
    moves (the policy would press against the box's wall for the whole episode); a goal may lie
    on the table (push's, at 1 mm), below the fingertips' floor."""
    from embodied.robots.safety import WORKSPACE_HIGH, WORKSPACE_LOW

    low = (*WORKSPACE_LOW[:2], 0.0)  # (the table)
    if all(lo <= g <= hi for g, lo, hi in zip(goal, low, WORKSPACE_HIGH, strict=True)):
        return
    ranges = ", ".join(
        f"{axis} in [{lo}, {hi}]" for axis, lo, hi in zip("xyz", low, WORKSPACE_HIGH)
    )
    raise ValueError(
        f"--goal {text!r}: outside the box the safety layer keeps the tool point in ({ranges} m, "
        "the arm's base frame)"
    )


def cmd_serve(args) -> int:
    import time

    from embodied.deploy import serve, serve_device

    if why := _missing_real("serve", ("msgpack", "websockets")):
        return _error(why)
    if not 0 <= args.port <= 65535:
        return _error(f"--port: must be 0..65535 (0: any free port), got {args.port}")
    if args.queue < 1:
        return _error(f"--queue: must be >= 1, got {args.queue}")
    device = serve_device(args.device)  # (a UserError: one line, from main)
    try:
        server = serve(
            args.checkpoint,
            host=args.host,
            port=args.port,
            queue_size=args.queue,
            device=device,
        )
    except FileNotFoundError as e:
        return _error(str(e))
    address = f"{args.host}:{server.port}"
    print(
        f"serving {args.checkpoint} on ws://{address}, the policy on {device} "
        f"(health: http://{address}/health)"
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


def cmd_deploy(args) -> int:
    import logging

    from embodied.deploy import DeployError, run_deploy
    from embodied.robots.arm import RobotError

    if why := _missing_real("deploy", REAL) or _deploy_options_refused(args):
        return _error(why)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        arm = _deploy_arm(args)
        goal = None
        if args.goal:
            goal = _floats("--goal", args.goal, 0.0, n=3, what="axis (metres: x,y,z)")
            _check_reachable(args.goal, goal)
        summary = run_deploy(
            args.checkpoint,
            arm,
            hz=args.hz,
            episode_seconds=args.episode_seconds,
            server=args.server,
            episodes=args.episodes,
            record=args.record,
            goal=goal,
            seed=args.seed,
            device=args.device,
        )
    except (DeployError, RobotError, ValueError, OSError) as e:
        # (a camera that stops giving frames: RobotEnv.observe's RobotError; a recording's disk
        # that fills up; a lost connection)
        return _error_with_notes(e)  # the shutdown's notes too
    print(json.dumps(summary, indent=2))
    if not summary["torque_off_at_safe_pose"]:
        print(
            "embodied: the arm did not reach its safe pose: its torque stays on (the log says "
            "why); move it by hand or run again",
            file=sys.stderr,
        )
        return 1
    return 0


def _deploy_options_refused(args) -> str | None:
    """What the options alone refuse, before the checkpoint is read or anything connects."""
    if args.hz is not None and not 0 < args.hz < math.inf:
        return f"--hz: must be > 0 and finite (Hz), got {args.hz:g}"
    if args.episodes < 1:
        return f"--episodes: must be >= 1, got {args.episodes}"
    if args.robot.startswith("koch"):  # (before the checkpoint is read: run_deploy's too)
        from embodied.deploy import KOCH_REFUSED

        return KOCH_REFUSED
    if args.episode_seconds is not None and not 0 < args.episode_seconds < math.inf:
        return f"--episode-seconds: must be > 0 and finite, got {args.episode_seconds:g}"
    if args.server and not args.server.startswith(("ws://", "wss://")):
        return f"--server {args.server!r}: expected ws://HOST:PORT (or wss://)"
    return _record_refused(Path(args.record)) if args.record else None


def _record_refused(record: Path) -> str | None:
    """Why the recordings cannot go to ``record``, which is made here: the episodes would run
    on the arm and then fail to be written."""
    if record.exists() and (not record.is_dir() or any(record.iterdir())):
        return f"--record {record}: not empty; give a new directory for the recordings"
    try:
        record.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"--record {record}: cannot be made ({e.strerror or e})"
    if not os.access(record, os.W_OK):
        return f"--record {record}: not writable here"
    return None


# what the robot commands import beyond the default install (the real extra, and LeRobot's own
# package, which scripts/setup.sh installs without its dependencies)
REAL = ("lerobot", "msgpack", "websockets")


def _missing_real(command: str, modules: tuple[str, ...]) -> str | None:
    """One line naming what ``command`` needs that is not installed, or None."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"{command} needs {', '.join(missing)}, not installed here: pip install "
        "'embodied[real]', then pip install --no-deps lerobot==0.4.4 (scripts/setup.sh with the "
        "real extra does both)"
    )


def _deploy_arm(args):
    """The arm's ArmConfig from deploy's options, checked (the robot and its port before the
    checkpoint is read)."""
    from embodied.robots.arm import ArmConfig

    arm = ArmConfig(
        robot=args.robot,
        port=args.robot_port or "",
        id=args.robot_id,
        cameras=_cameras(args.camera),
        instruction=args.instruction,
        joint_signs=_floats("--robot.joint-signs", args.joint_signs, 1.0),
        joint_offsets=_floats("--robot.joint-offsets", args.joint_offsets, 0.0),
        watchdog_s=args.watchdog,
        **({} if args.max_speed is None else {"max_speed": args.max_speed}),
        **_gripper_range(args),
    )
    arm.validate()
    return arm


def _error_with_notes(e: BaseException) -> int:
    """``e`` as the one error line, with what was noted on it (what a shutdown or a release of the
    arm failed to do)."""
    return _error("; ".join([str(e), *getattr(e, "__notes__", [])]))


def cmd_read_arm(args) -> int:
    from embodied.read_arm import arm_robot, read_arm
    from embodied.robots.arm import ArmConfig, RobotError

    if why := _missing_real("read-arm", ("lerobot",)):
        return _error(why)
    if args.readings is not None and args.readings < 1:
        return _error(f"--readings: must be >= 1, got {args.readings}")
    if not 0.1 <= args.hz <= 100:
        return _error(f"--hz: readings a second, 0.1 to 100, got {args.hz:g}")
    try:
        arm = ArmConfig(
            robot=args.robot, port=args.robot_port or "", id=args.robot_id, **_gripper_range(args)
        )
        arm.validate()
        read_arm(arm_robot(arm), arm, readings=args.readings, hz=args.hz)
    except (RobotError, ValueError, FileNotFoundError, ConnectionError, RuntimeError) as e:
        return _error_with_notes(e)
    return 0


def add_robot_commands(sub) -> None:
    """The serve, deploy and read-arm subcommands of ``embodied``'s parser."""
    _add_serve(sub)
    _add_deploy(sub)
    _add_read_arm(sub)


def _add_arm_options(parser, robots: str = "so100 | so101 | koch | so100-sim | so101-sim") -> None:
    parser.add_argument("--robot", default="so101", help=robots)
    parser.add_argument(
        "--robot.port", dest="robot_port", help="the arm's serial port, e.g. /dev/ttyACM0"
    )
    parser.add_argument(
        "--robot.id", dest="robot_id", default="embodied", help="LeRobot calibration id"
    )
    parser.add_argument(
        "--robot.gripper-range",
        dest="gripper_range",
        help="CLOSED,OPEN: the gripper's radians at LeRobot's 0 and 100, written with = before "
        "a minus sign (default: the SO-101 description's, --robot.gripper-range=-0.17453,1.74533; "
        "docs/so101.md says how to check it)",
    )


def _add_read_arm(sub) -> None:
    r = sub.add_parser(
        "read-arm",
        help="print an arm's joint readings, torque off, to check its zeros and signs",
        description="Connect the arm with its LeRobot calibration, switch its torque off and "
        "print its joints while you move it by hand: degrees as LeRobot reads them, which the "
        "model's radians follow (docs/so101.md, 'Checking a real arm'). Ctrl-C ends.",
    )
    _add_arm_options(r)
    r.add_argument("--readings", type=int, help="how many (default: until Ctrl-C)")
    r.add_argument("--hz", type=float, default=5.0, help="readings a second")
    r.set_defaults(func=cmd_read_arm)


def _add_serve(sub) -> None:
    v = sub.add_parser(
        "serve",
        help="serve a checkpoint's policy over a websocket",
        description="Serve CHECKPOINT's policy (msgpack over websocket) to "
        "`embodied deploy --server`.",
    )
    v.add_argument("checkpoint", help="a checkpoint directory or RUN/last")
    v.add_argument("--host", default="0.0.0.0")
    v.add_argument("--port", type=int, default=8765)
    v.add_argument(
        "--queue", type=int, default=8, help="requests waiting at most; more get a 'busy' reply"
    )
    v.add_argument(
        "--device",
        default="auto",
        help="where the policy runs: auto (cuda where this machine has it, else cpu), cpu, cuda "
        "or cuda:N",
    )
    v.set_defaults(func=cmd_serve)


def _add_deploy(sub) -> None:
    y = sub.add_parser(
        "deploy",
        help="drive a robot arm (or its digital twin) with a checkpoint",
        description="Run CHECKPOINT on an SO-100/SO-101 arm through LeRobot's drivers (or "
        "so101-sim, the MuJoCo twin), every command through the safety layer. Enter, "
        "Ctrl-C or SIGTERM stops; the arm then goes to its safe pose and torque is "
        "switched off there.",
    )
    y.add_argument("checkpoint", help="a checkpoint directory or RUN/last")
    # (the Koch is refused until its geometry is in the safety layer)
    _add_arm_options(y, robots="so100 | so101 | so100-sim | so101-sim")
    y.add_argument("--camera", action="append", help="NAME=SOURCE, once per camera the policy uses")
    y.add_argument(
        "--server", help="ws://HOST:PORT of `embodied serve` (default: infer in this process)"
    )
    y.add_argument(
        "--device",
        default="auto",
        help="without --server, where the policy runs: auto (cuda where this machine has it, "
        "else cpu), cpu, cuda or cuda:N",
    )
    y.add_argument(
        "--instruction",
        default="",
        help="the task in words (for language-conditioned policies; default: the one it was "
        "trained on)",
    )
    y.add_argument(
        "--hz", type=float, help="control rate (default: the rate the policy was trained at)"
    )
    y.add_argument("--episodes", type=int, default=1)
    y.add_argument(
        "--episode-seconds",
        type=float,
        help="each episode's length (default: the policy's training episodes', as eval has them)",
    )
    y.add_argument("--record", help="directory for one LeRobot dataset per episode")
    y.add_argument(
        "--goal",
        help="X,Y,Z: the goal the policy is given (metres, the arm's base frame), for policies "
        "trained with policy.privileged_keys=[goal_pos], written with = before a minus sign "
        "(--goal=-0.05,0.2,0.1); the twin draws one per episode without (pick's is the cube's "
        "place at z = 0.065: the twin puts its cube under it; push's is on the table, z = 0.001, "
        "the cube behind it)",
    )
    y.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the twin's scenes: episode e is embodied eval's episode e at this seed",
    )
    _add_deploy_arm_options(y)
    y.set_defaults(func=cmd_deploy)


def _add_deploy_arm_options(y) -> None:
    """Deploy's options for how the arm is driven: joint conventions, watchdog, speed."""
    y.add_argument(
        "--robot.joint-signs",
        dest="joint_signs",
        help="policy = sign * arm + offset per joint, e.g. --robot.joint-signs=-1,1,1,1,1,1 "
        "(a policy trained with another simulator's joint conventions)",
    )
    y.add_argument(
        "--robot.joint-offsets",
        dest="joint_offsets",
        help="radians, 6 comma-separated values, written with = before a minus sign "
        "(--robot.joint-offsets=-0.1,0,0,0,0,0)",
    )
    y.add_argument(
        "--robot.watchdog",
        dest="watchdog",
        type=float,
        default=1.0,
        help="seconds without a fresh action that stop an episode (the arm holds from a quarter "
        "of it); raise it for a policy whose inference outlasts its chunks",
    )
    y.add_argument(
        "--robot.max-speed",
        dest="max_speed",
        type=float,
        help="rad/s per joint, the safety layer's rate limit (default 2, the simulator's); "
        "lower it for a first run",
    )
