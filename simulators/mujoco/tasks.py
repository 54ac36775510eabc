"""Table-top tasks for the MuJoCo desktop arm: what is in the scene, how an episode starts, the
normalized dense reward (in [0, 1], 1 on success) and success, vectorized over worlds in torch on
the env's device. Both backends (``mujoco.rollout`` and MuJoCo Warp) call these very functions, so
equal seeds give equal initial states on either, and a reward means the same on both."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embodied.simulators.mujoco.arm import WORLD_COLLISION

GOAL_MARKER = (
    '<body name="goal" mocap="true" pos="0.2 0 0.1">'
    '<geom type="sphere" size="0.015" rgba="0.1 0.9 0.1 0.6" contype="0" conaffinity="0"/>'
    "</body>"
)
PUSH_RADIUS = 0.025  # metres: push succeeds with the cube's centre within the red disc drawn
GOAL_REGION = (
    '<body name="goal" mocap="true" pos="0.2 0 0.001">'
    f'<geom type="cylinder" size="{PUSH_RADIUS} 0.001" rgba="0.9 0.1 0.1 0.7" contype="0" '
    'conaffinity="0"/>'
    "</body>"
)
CUBE_HALF = 0.015  # metres
LIFT = 0.05  # metres the pick task lifts the cube


@dataclass(frozen=True)
class Task:
    name: str
    instruction: str
    bodies: str  # MJCF inside <worldbody>
    sensors: str  # MJCF inside <sensor>: each privileged key is a sensor of the same name
    privileged: dict[str, int] = field(default_factory=dict)  # key -> size
    max_episode_steps: int = 50
    num_draws: int = 3  # uniforms per reset that ``sample`` takes
    reads: tuple[str, ...] = ()  # sensors ``evaluate`` reads besides the privileged ones

    def sample(self, u: torch.Tensor, cube_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """Uniforms f32 [N, num_draws] and each world's cube size (f32 [N], relative to
        CUBE_HALF: domain randomisation, else 1) -> an initial state's task part, f32 [N, 3]
        each: the goal (mocap) position and object positions ("cube", resting on the table)."""
        raise NotImplementedError

    def evaluate(self, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sensor readings by name (f32 [B, 3] positions, f32 [B, 1] joints) -> (reward f32 [B]
        in [0, 1], success bool [B])."""
        raise NotImplementedError

    def cube_under(self, goal: tuple[float, ...], size_range: float) -> tuple[float, ...] | None:
        """Where a goal a user gives puts the cube (metres), for a task whose goal is drawn from
        the cube's place, its size within ``size_range`` of the model's (randomize.cube_size);
        None for a task without a cube (ValueError: a goal it never has)."""
        return None


def _between(u: torch.Tensor, low: tuple[float, ...], high: tuple[float, ...]) -> torch.Tensor:
    """Uniforms f32 [N, D] in [0, 1) -> f32 [N, D] in [low, high) per column (Python floats:
    no host-to-device copy in a reset)."""
    columns = [lo + u[:, i] * (hi - lo) for i, (lo, hi) in enumerate(zip(low, high))]
    return torch.stack(columns, 1)


class Reach(Task):
    """Bring the gripper's tool point within 2 cm of a target in the air."""

    def sample(self, u, cube_scale):
        return {"goal": _between(u, (0.14, -0.12, 0.04), (0.3, 0.12, 0.18))}

    def evaluate(self, s):
        d = torch.linalg.vector_norm(s["tcp_pos"] - s["goal_pos"], dim=-1)
        success = d < 0.02
        return (1.0 - torch.tanh(10.0 * d)).masked_fill(success, 1.0), success


class Push(Task):
    """Push the cube into the red target region on the table (cube centre within 2.5 cm)."""

    OFFSET = ((0.05, -0.03), (0.08, 0.03))  # the goal from the cube (x, y), low and high

    def sample(self, u, cube_scale):
        cube_xy = _between(u[:, :2], (0.17, -0.08), (0.22, 0.08))
        offset = _between(u[:, 2:], *self.OFFSET)
        on_table = CUBE_HALF * cube_scale[:, None]  # f32 [N, 1]: its centre at rest
        cube = torch.cat([cube_xy, on_table], 1)
        goal = torch.cat([cube_xy + offset, torch.full_like(on_table, 0.001)], 1)
        return {"goal": goal, "cube": cube}

    def evaluate(self, s):
        cube = s["cube_pos"]
        goal = s["goal_pos"]
        tcp = s["tcp_pos"]
        to_goal = goal[:, :2] - cube[:, :2]
        d_goal = torch.linalg.vector_norm(to_goal, dim=-1)
        direction = to_goal / d_goal.clamp_min(1e-6)[:, None]
        # where the tool should be to push towards the goal
        behind_xy = cube[:, :2] - direction * (CUBE_HALF + 0.02)
        behind = torch.cat([behind_xy, cube[:, 2:]], 1)
        reach = 1.0 - torch.tanh(10.0 * torch.linalg.vector_norm(tcp - behind, dim=-1))
        place = 1.0 - torch.tanh(10.0 * d_goal)
        success = d_goal < PUSH_RADIUS
        return ((reach + 2.0 * place) / 3.0).masked_fill(success, 1.0), success

    def cube_under(self, goal, size_range):
        """The cube behind the goal by the middle of push's offsets (it started inside the
        success radius of a goal given apart from it); the goal is on the table."""
        if abs(goal[2] - 0.001) > 1e-3:
            raise ValueError(f"push's goal is on the table, at z = 0.001, got z = {goal[2]:g}")
        (low_x, low_y), (high_x, high_y) = self.OFFSET
        behind = (goal[0] - (low_x + high_x) / 2, goal[1] - (low_y + high_y) / 2)
        return (*behind, CUBE_HALF)


class Pick(Task):
    """Pick the cube up and lift it: success once its centre is LIFT above where it rested (a
    randomised cube rests at its own half-size). The goal marks that height above the cube's
    start; the reward and success measure from it, so each world's from its own cube."""

    def sample(self, u, cube_scale):
        cube_xy = _between(u, (0.16, -0.08), (0.25, 0.08))
        on_table = CUBE_HALF * cube_scale[:, None]  # f32 [N, 1]: its centre at rest
        return {
            "goal": torch.cat([cube_xy, on_table + LIFT], 1),
            "cube": torch.cat([cube_xy, on_table], 1),
        }

    def evaluate(self, s):
        cube = s["cube_pos"]
        lifted = s["goal_pos"][:, 2]  # f32 [B]: where the cube rested, plus LIFT
        d_cube = torch.linalg.vector_norm(s["tcp_pos"] - cube, dim=-1)
        reach = 1.0 - torch.tanh(10.0 * d_cube)
        # the jaws stopped by the cube around the tool point: it is held
        grasped = (d_cube < 0.015) & (s["gripper.pos"][:, 0] < 0.45)
        lift = ((cube[:, 2] - (lifted - LIFT)) / LIFT).clamp(0.0, 1.0)
        success = cube[:, 2] >= lifted
        dense = (reach + grasped.float() + 2.0 * lift) / 4.0
        return dense.masked_fill(success, 1.0), success

    def cube_under(self, goal, size_range):
        """The cube at rest LIFT below the goal."""
        low, high = (CUBE_HALF * (1.0 + side * size_range) + LIFT for side in (-1, 1))
        if not low - 1e-3 <= goal[2] <= high + 1e-3:
            heights = f"z = {low:g}" if low == high else f"z in [{low:g}, {high:g}]"
            raise ValueError(
                f"pick's goal is {LIFT:g} m over the cube's centre at rest, at {heights} (its "
                f"x, y: the cube's place), got z = {goal[2]:g}"
            )
        return (goal[0], goal[1], goal[2] - LIFT)


GOAL_AND_CUBE = (  # the sensors of the tasks with a cube, each a privileged key of its name
    '<framepos name="goal_pos" objtype="body" objname="goal"/>'
    '<framepos name="cube_pos" objtype="body" objname="cube"/>'
)


def _cube(rgba: str) -> str:
    return (
        f'<body name="cube" pos="0.2 0 {CUBE_HALF}"><freejoint/><geom type="box" '
        f'size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" rgba="{rgba}" mass="0.03" friction="1 0.01 '
        f'0.001" {WORLD_COLLISION}/></body>'
    )


TASKS: dict[str, Task] = {
    "reach": Reach(
        name="reach",
        instruction="move the gripper to the green ball",
        bodies=GOAL_MARKER,
        sensors='<framepos name="goal_pos" objtype="body" objname="goal"/>',
        privileged={"goal_pos": 3},
    ),
    "push": Push(
        name="push",
        instruction="push the cube to the red target",
        bodies=GOAL_REGION + _cube("0.2 0.3 0.9 1"),
        sensors=GOAL_AND_CUBE,
        privileged={"goal_pos": 3, "cube_pos": 3},
        max_episode_steps=80,
        num_draws=4,
    ),
    "pick": Pick(
        name="pick",
        instruction="pick up the cube and lift it",
        bodies=GOAL_MARKER + _cube("0.9 0.5 0.1 1"),
        sensors=GOAL_AND_CUBE,
        privileged={"goal_pos": 3, "cube_pos": 3},
        max_episode_steps=100,
        num_draws=2,
        reads=("gripper.pos",),
    ),
}
