"""ManiSkill's tasks as registered, before anything is built: each task's instruction, and the
checks that a config names what the task has (the task itself, its assets on disk, its reward
mode, its robot's controller), each a one-line ``UserError`` where it does not."""

from __future__ import annotations

import difflib

from embodied.schema import UserError

# Natural-language instructions per task; other tasks get their name split into words.
INSTRUCTIONS = {
    "PushCube-v1": "push the cube to the red and white target",
    "PullCube-v1": "pull the cube back to the red and white target",
    "PickCube-v1": "pick up the cube and move it to the green goal",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PokeCube-v1": "use the peg to poke the cube to the goal",
    "PushT-v1": "push the T-shaped block onto the target",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "roll the ball to the goal region",
    "LiftPegUpright-v1": "lift the peg so that it stands upright",
    "PegInsertionSide-v1": "insert the peg into the hole from the side",
    "PickCubeSO100-v1": "pick up the cube",
}


class MissingAssetError(UserError, RuntimeError):
    """A task's assets are not on disk (the user installs them; nothing is downloaded)."""


def instruction_for(task: str) -> str:
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    name = task.rsplit("-v", 1)[0]
    return "".join(" " + c.lower() if c.isupper() else c for c in name).strip()


def _refuse_prompt(message: str) -> bool:
    raise MissingAssetError(
        f"{message.strip()} -- not downloading interactively; fetch them with "
        "`python -m mani_skill.utils.download_asset <asset-id>` (needs internet)"
    )


def check_assets(task: str) -> None:
    """Raise MissingAssetError naming every asset the task needs that is not on disk, and make
    ManiSkill's own interactive download prompt raise instead of waiting for stdin."""
    import mani_skill.envs  # noqa: F401  (registers the tasks)
    from mani_skill.utils import assets, download_asset
    from mani_skill.utils.registration import REGISTERED_ENVS

    download_asset.prompt_yes_no = _refuse_prompt
    if task not in REGISTERED_ENVS:
        close = difflib.get_close_matches(str(task), list(REGISTERED_ENVS), n=3)
        if close:
            hint = f"did you mean {' or '.join(map(repr, close))}?"
        else:
            hint = f"registered: {', '.join(sorted(REGISTERED_ENVS)[:12])}, ..."
        raise UserError(f"unknown ManiSkill task {task!r}; {hint}")
    missing = []
    robot = _default_robot(task)  # (its own assets: a robot's description, meshes)
    robot_ids = [] if robot is None else _robot_assets(robot)
    fetch = []  # what download_asset is given: the task fetches the task's own
    for asset_id in [*(REGISTERED_ENVS[task].asset_download_ids or []), *robot_ids]:
        ids = (
            assets.expand_data_group_into_individual_data_source_ids(asset_id)
            if asset_id in assets.DATA_GROUPS
            else [asset_id]
        )
        for source_id in ids:
            if not assets.is_data_source_downloaded(source_id):
                src = assets.DATA_SOURCES[source_id]
                missing.append(f"{source_id} (expected at {src.output_dir / src.target_path})")
                fetch.append(source_id if asset_id in robot_ids else task)
    if missing:
        shown = ", ".join(missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        commands = [
            f"`python -m mani_skill.utils.download_asset {f}`" for f in dict.fromkeys(fetch)
        ]
        raise MissingAssetError(
            f"ManiSkill task {task} needs assets that are not installed: {shown}. Get them with "
            f"{' and '.join(commands)} on a machine with internet, or set MS_ASSET_DIR to where "
            "they are."
        )


def check_reward_mode(task: str, reward_mode: str) -> None:
    """A UserError where ``task`` (registered) computes no reward of ``reward_mode`` (ManiSkill's
    NotImplementedError in every worker otherwise)."""
    from mani_skill.utils.registration import REGISTERED_ENVS

    supported = list(REGISTERED_ENVS[task].cls.SUPPORTED_REWARD_MODES)
    if reward_mode not in supported:
        raise UserError(
            f"env.reward_mode: {task} rewards {', '.join(supported)}, not {reward_mode!r}"
        )


def action_space(control_mode: str) -> str:
    """The contract's action space (schema.ACTION_SPACES) of a ManiSkill control mode; a
    UserError for velocities, which none holds. The checks that a policy's actions are an
    environment's compare it: pd_ee_target_delta_pose was labelled ee_pose and pd_joint_vel
    joint_pos, so a policy of absolute poses passed as one of deltas."""
    if "_vel" in control_mode:
        raise UserError(
            f"env.control_mode: {control_mode} commands velocities; the actions a policy gives "
            "are joint positions or deltas, or end-effector poses or deltas"
        )
    delta = "delta" in control_mode
    if "_ee_" in control_mode:
        return "ee_delta_pose" if delta else "ee_pose"
    return "joint_delta" if delta else "joint_pos"


def check_control_mode(task: str, control_mode: str | None) -> None:
    """A UserError where the robot of ``task`` (registered) has no controller ``control_mode``
    (ManiSkill's AssertionError in every worker otherwise), or one of velocities."""
    if control_mode is not None:
        action_space(control_mode)
    modes = _control_modes(task)
    if control_mode is None or modes is None or control_mode in modes[1]:
        return
    robot, names = modes
    raise UserError(
        f"env.control_mode: {task}'s robot ({robot}) has the controllers {', '.join(names)}, "
        f"not {control_mode!r}"
    )


def _default_robot(task: str) -> str | None:
    """The registered robot ``task`` builds by default, read without building a scene; None
    where that cannot be read so (several robots, or one its ``__init__`` names)."""
    import inspect

    from mani_skill.agents.registration import REGISTERED_AGENTS
    from mani_skill.utils.registration import REGISTERED_ENVS

    spec = REGISTERED_ENVS[task]
    robot = spec.default_kwargs.get("robot_uids")
    parameters = inspect.signature(spec.cls.__init__).parameters
    if robot is None and "robot_uids" in parameters:  # (a task of one robot may take none)
        robot = parameters["robot_uids"].default
    if not isinstance(robot, str) or robot not in REGISTERED_AGENTS:
        return None
    return robot


def _robot_assets(robot: str) -> list[str]:
    from mani_skill.agents.registration import REGISTERED_AGENTS

    return list(REGISTERED_AGENTS[robot].asset_download_ids or [])


def _control_modes(task: str) -> tuple[str, list[str]] | None:
    """(the task's default robot, its controllers' names), read without building a scene; None
    where that cannot be read so (a robot of another kind: the worker's error stands)."""
    from mani_skill.agents.registration import REGISTERED_AGENTS

    robot = _default_robot(task)
    if robot is None:
        return None
    agent = object.__new__(REGISTERED_AGENTS[robot].agent_cls)
    try:  # (the controllers are a property of the agent's class attributes)
        return robot, sorted(agent._controller_configs)
    except Exception:  # (an agent whose controllers need its scene)
        return None
