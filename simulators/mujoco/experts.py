"""Scripted experts for the MuJoCo tasks: they prove each task solvable and record demonstrations
(``embodied demos`` with ``expert: scripted``).

An expert acts from the observation alone (joints, tool point, cube and goal), batched over
worlds in torch on the env's device, with no memory between steps: each step it chooses a
waypoint for the tool point from where things are, solves the SO-101's inverse kinematics for it
(simulators/mujoco/ik.py) and moves the servo targets toward the solution by at most the task's
action limit. So the same expert runs on both backends and on any number of worlds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embodied.schema import Observation, PolicyOutput
from embodied.simulators.mujoco.arm import GRIPPER_CLOSED, GRIPPER_OPEN
from embodied.simulators.mujoco.ik import ARM_JOINTS, Chain
from embodied.simulators.mujoco.tasks import CUBE_HALF
from embodied.simulators.mujoco.worlds import MAX_DELTA

ABOVE = 0.04  # metres above the cube where an approach starts
DESCENT = 0.01  # metres a step at most that an approach goes down
SQUEEZE = 0.2  # radians: the gripper's target on a 3 cm cube (held at 0.33): a firm grip
FINGERS = 0.01  # metres from the tool point back to the middle of the closed fingers
PUSH_HEIGHT = 0.012  # metres: the tool point's height while pushing (the pads just clear the table)
JAW_OFFSET = 0.009  # metres from the tool point to the middle of the open jaws' gap


@dataclass
class Plan:
    """Where the tool point goes (f32 [B, 3]), the gripper's target (f32 [B], radians) and, if
    given, the table direction its jaws should close across (f32 [B, 2])."""

    waypoint: torch.Tensor
    gripper: torch.Tensor
    across: torch.Tensor | None = None


class Expert:
    """Steer the tool point to a waypoint each step; subclasses choose waypoint and gripper."""

    down = True  # the gripper points down, its jaws along a table axis

    def __init__(self, device: torch.device | str = "cpu", gain: float = 0.5):
        self.chain = Chain(device)
        self.gain = gain

    def plan(self, obs: Observation) -> Plan:
        raise NotImplementedError

    @torch.no_grad()
    def act(self, obs: Observation, *, deterministic: bool = True) -> PolicyOutput:
        """A chunk of one action, f32 [B, 1, 6] joint deltas (radians) within the action limit."""
        joints = obs.state[:, :6]  # f32 [B, 6] measured joint positions
        plan = self.plan(obs)
        arm = self.chain.solve(plan.waypoint, joints, down=self.down, across=plan.across)
        wanted = torch.cat([arm, plan.gripper[:, None]], 1)  # f32 [B, 6]
        # a fraction of the way each step: the servo targets integrate the deltas
        delta = (self.gain * (wanted - joints)).clamp(-MAX_DELTA, MAX_DELTA)
        return PolicyOutput(actions=delta[:, None], logprob=torch.zeros(len(delta)))


class ReachExpert(Expert):
    """The tool point straight to the goal, the gripper as it is."""

    down = False

    def plan(self, obs):
        return Plan(obs.privileged["goal_pos"], obs.state[:, ARM_JOINTS])


def _flat(xy: torch.Tensor, z: float) -> torch.Tensor:
    """f32 [B, 3]: points at height z over xy (f32 [B, 2])."""
    return torch.cat([xy, torch.full_like(xy[:, :1], z)], 1)


def _funnel(point: torch.Tensor, off: torch.Tensor, tcp: torch.Tensor) -> torch.Tensor:
    """f32 [B, 3]: ``point``, raised by up to ABOVE the further the tool is from it in the table's
    plane (``off``, f32 [B]): an approach from above that descends as it centres, by at most
    DESCENT a step below the tool point (``tcp``, f32 [B, 3]), so that a joint-space move stays
    near the straight line down."""
    rise = ((off - 0.003) * 8.0).clamp(0.0, ABOVE)  # f32 [B]
    height = torch.maximum(point[:, 2] + rise, tcp[:, 2] - DESCENT)  # f32 [B]
    return torch.cat([point[:, :2], height[:, None]], 1)


class PushExpert(Expert):
    """Lower the closed fingers behind the cube (seen from the goal), their flat side to it, and
    push it onto the goal; where the fingers are not behind the cube, come down again from
    above."""

    def plan(self, obs):
        cube = obs.privileged["cube_pos"]
        goal = obs.privileged["goal_pos"]
        tcp = obs.privileged["tcp_pos"]
        _, frame = self.chain.forward(obs.state[:, :6])
        jaw = frame[:, :, 0]  # f32 [B, 3]: from the fixed jaw toward the moving one
        fingers = tcp - FINGERS * jaw  # f32 [B, 3]: the middle of the closed fingers
        to_goal = goal[:, :2] - cube[:, :2]
        left = to_goal.norm(dim=1, keepdim=True)  # f32 [B, 1]
        direction = to_goal / left.clamp_min(1e-6)  # f32 [B, 2]
        # the fingers (1.8 cm thick) a centimetre short of the cube
        behind = cube[:, :2] - direction * (CUBE_HALF + 0.02)
        off = (fingers[:, :2] - behind).norm(dim=1)  # f32 [B]
        # down behind it: on until a centimetre from the goal's centre; else down onto that place
        pushing = (off < 0.012) & (tcp[:, 2] < PUSH_HEIGHT + 0.008)
        ahead = behind + direction * (left - 0.01).clamp(0.0, 0.03)
        place = torch.where(pushing[:, None], ahead, behind)
        target = torch.where(
            pushing[:, None],
            _flat(place, PUSH_HEIGHT),
            _funnel(_flat(place, PUSH_HEIGHT), off, tcp),
        )
        closed = torch.full_like(tcp[:, 0], GRIPPER_CLOSED)
        return Plan(target + FINGERS * jaw, closed, across=direction)


class PickExpert(Expert):
    """Over the cube with the jaws open, down around it, close, lift it to the goal's height."""

    def plan(self, obs):
        cube = obs.privileged["cube_pos"]
        tcp = obs.privileged["tcp_pos"]
        joints = obs.state[:, :6]
        _, frame = self.chain.forward(joints)
        jaw = frame[:, :, 0]  # f32 [B, 3]: from the fixed jaw toward the moving one
        # the open jaws' gap is centred JAW_OFFSET past the tool point (toward the moving jaw), so
        # the tool aims that much short of the cube; closing pushes the cube onto the fixed jaw
        aim = cube - JAW_OFFSET * jaw
        off = (tcp[:, :2] - aim[:, :2]).norm(dim=1)  # f32 [B]
        at_cube = (tcp - aim).norm(dim=1) < 0.006
        held = ((tcp - cube).norm(dim=1) < 0.02) & (joints[:, ARM_JOINTS] < 0.45)
        # the goal marks the lift's height over where the cube started: a fixed point to hold
        lifted = obs.privileged["goal_pos"] + tcp.new_tensor([0.0, 0.0, 0.015])
        waypoint = torch.where(held[:, None], lifted, _funnel(aim, off, tcp))
        gripper_target = torch.where(at_cube | held, SQUEEZE, GRIPPER_OPEN)
        return Plan(waypoint, gripper_target)


EXPERTS = {"reach": ReachExpert, "push": PushExpert, "pick": PickExpert}
