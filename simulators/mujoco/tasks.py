"""Table-top tasks for the MuJoCo desktop arm: what is in the scene, how an episode starts, the
normalized dense reward (in [0, 1], 1 on success) and success, all vectorized over environments
(numpy [B, ...] in, [B] out)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GOAL_MARKER = (
    '<body name="goal" mocap="true" pos="0.2 0 0.1">'
    '<geom type="sphere" size="0.015" rgba="0.1 0.9 0.1 0.6" contype="0" conaffinity="0"/>'
    "</body>"
)
GOAL_REGION = (
    '<body name="goal" mocap="true" pos="0.2 0 0.001">'
    '<geom type="cylinder" size="0.03 0.001" rgba="0.9 0.1 0.1 0.7" contype="0" conaffinity="0"/>'
    "</body>"
)
CUBE_HALF = 0.015  # metres


@dataclass(frozen=True)
class Task:
    name: str
    instruction: str
    bodies: str  # MJCF inside <worldbody>
    sensors: str  # MJCF inside <sensor>: each privileged key is a sensor of the same name
    privileged: dict[str, int] = field(default_factory=dict)  # key -> size
    max_episode_steps: int = 50

    def sample(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """An initial state's task part: goal (mocap) position and object positions."""
        raise NotImplementedError

    def evaluate(self, s: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Sensor readings f64 [B, 3] by name -> (reward f32 [B] in [0, 1], success bool [B])."""
        raise NotImplementedError


class Reach(Task):
    """Bring the gripper's tool point within 2 cm of a target in the air."""

    def sample(self, rng):
        return {
            "goal": np.array(
                [rng.uniform(0.14, 0.28), rng.uniform(-0.14, 0.14), rng.uniform(0.05, 0.2)]
            )
        }

    def evaluate(self, s):
        d = np.linalg.norm(s["tcp_pos"] - s["goal_pos"], axis=-1)
        success = d < 0.02
        return np.where(success, 1.0, 1.0 - np.tanh(10.0 * d)).astype(np.float32), success


class Push(Task):
    """Push the cube into the red target region on the table (cube centre within 2.5 cm)."""

    def sample(self, rng):
        cube = np.array([rng.uniform(0.16, 0.22), rng.uniform(-0.08, 0.08), CUBE_HALF])
        goal = cube + np.array(
            [rng.uniform(0.05, 0.09), rng.uniform(-0.03, 0.03), -CUBE_HALF + 0.001]
        )
        return {"goal": goal, "cube": cube}

    def evaluate(self, s):
        cube = s["cube_pos"]
        goal = s["goal_pos"]
        tcp = s["tcp_pos"]
        to_goal = goal[:, :2] - cube[:, :2]
        d_goal = np.linalg.norm(to_goal, axis=-1)
        direction = to_goal / np.maximum(d_goal, 1e-6)[:, None]
        behind = cube.copy()
        # where the tool should be to push towards the goal
        behind[:, :2] -= direction * (CUBE_HALF + 0.02)
        reach = 1.0 - np.tanh(10.0 * np.linalg.norm(tcp - behind, axis=-1))
        place = 1.0 - np.tanh(10.0 * d_goal)
        success = d_goal < 0.025
        return np.where(success, 1.0, (reach + 2.0 * place) / 3.0).astype(np.float32), success


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
        bodies=GOAL_REGION
        + f'<body name="cube" pos="0.2 0 {CUBE_HALF}"><freejoint/><geom type="box" '
        f'size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" rgba="0.2 0.3 0.9 1" mass="0.05" '
        'friction="0.8"/></body>',
        sensors='<framepos name="goal_pos" objtype="body" objname="goal"/>'
        '<framepos name="cube_pos" objtype="body" objname="cube"/>',
        privileged={"goal_pos": 3, "cube_pos": 3},
        max_episode_steps=80,
    ),
}
