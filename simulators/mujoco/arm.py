"""A 5-DoF desktop arm with a one-jaw gripper, in the class of the SO-100/SO-101 (same joint
names and order as LeRobot's SO-100 driver, similar link lengths and ranges), written as MJCF
here from primitive shapes: no meshes, nothing downloaded. Position servos on every joint, as on
the real arm's Feetech motors. The real-robot issue uses it as the digital twin.

Zero pose: upper arm straight up from the shoulder, forearm and gripper pointing forward (+x).
"""

from __future__ import annotations

JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
# radians; the gripper opens from 0 (closed) to 1.7
RANGES = {
    "shoulder_pan": (-1.9, 1.9),
    "shoulder_lift": (-1.75, 1.75),
    "elbow_flex": (-1.7, 1.7),
    "wrist_flex": (-1.7, 1.7),
    "wrist_roll": (-2.8, 2.8),
    "gripper": (0.0, 1.7),
}
# tool point about 10 cm above the table, in front of the base
HOME = {
    "shoulder_pan": 0.0,
    "shoulder_lift": 0.0,
    "elbow_flex": 0.3,
    "wrist_flex": 0.5,
    "wrist_roll": 0.0,
    "gripper": 0.2,
}
# link lengths, metres
BASE_HEIGHT = 0.1
UPPER_ARM = 0.116
FOREARM = 0.135
WRIST_TO_TCP = 0.1

# Collision bits: the arm's geoms (type 2, affinity 1) touch the table and the objects (type 1,
# affinity 3) but never each other, as the real arm's links do not (its joint limits keep them
# apart). Without this the wrist and the moving jaw touched at rest, and how two solvers resolve
# such a standing contact is where MuJoCo and MuJoCo Warp differed most.
ARM_COLLISION = 'contype="2" conaffinity="1"'
WORLD_COLLISION = 'contype="1" conaffinity="3"'
_LINK = f'rgba="0.95 0.95 0.95 1" {ARM_COLLISION}'
_MOTOR = f'rgba="0.1 0.1 0.1 1" {ARM_COLLISION}'


def _joint(name: str, axis: str) -> str:
    lo, hi = RANGES[name]
    return f'<joint name="{name}" axis="{axis}" range="{lo} {hi}" damping="0.5" armature="0.01"/>'


def arm_body() -> str:
    """The arm's <body> tree, its base on the table at the origin; the tool point is site "tcp"."""
    fixed_jaw = (
        '<geom name="fixed_jaw" type="box" size="0.04 0.006 0.015" pos="0.04 0.012 0" '
        f'{_LINK} mass="0.03"/>'
    )
    return f"""
<body name="base" pos="0 0 0">
  <geom type="cylinder" size="0.045 0.025" pos="0 0 0.025" {_MOTOR} mass="0.4"/>
  <body name="shoulder" pos="0 0 0.05">
    {_joint("shoulder_pan", "0 0 1")}
    <geom type="box" size="0.025 0.03 0.025" pos="0 0 0.025" {_MOTOR} mass="0.1"/>
    <body name="upper_arm" pos="0 0 {BASE_HEIGHT - 0.05}">
      {_joint("shoulder_lift", "0 1 0")}
      <geom type="capsule" fromto="0 0 0 0 0 {UPPER_ARM}" size="0.018" {_LINK} mass="0.1"/>
      <body name="forearm" pos="0 0 {UPPER_ARM}">
        {_joint("elbow_flex", "0 1 0")}
        <geom type="capsule" fromto="0 0 0 {FOREARM} 0 0" size="0.016" {_LINK} mass="0.08"/>
        <body name="wrist" pos="{FOREARM} 0 0">
          {_joint("wrist_flex", "0 1 0")}
          <geom type="box" size="0.02 0.02 0.018" pos="0.02 0 0" {_MOTOR} mass="0.05"/>
          <body name="hand" pos="0.04 0 0">
            {_joint("wrist_roll", "1 0 0")}
            {fixed_jaw}
            <site name="tcp" pos="{WRIST_TO_TCP - 0.04} 0 0" size="0.005" rgba="1 0 0 0.5"/>
            <camera name="wrist_camera" pos="0.0 0 0.04" xyaxes="0 -1 0 0.5 0 0.87" fovy="70"/>
            <body name="moving_jaw" pos="0.0 -0.012 0">
              {_joint("gripper", "0 0 1")}
              <geom type="box" size="0.04 0.006 0.015" pos="0.04 0 0" {_LINK} mass="0.02"/>
            </body>
          </body>
        </body>
      </body>
    </body>
  </body>
</body>"""


def actuators() -> str:
    """A position servo per joint (kp in N m / rad), limited to the joint's range."""
    lines = []
    for name in JOINTS:
        lo, hi = RANGES[name]
        kp = 3.0 if name == "gripper" else 20.0
        lines.append(
            f'<position name="{name}" joint="{name}" kp="{kp}" kv="0.5" '
            f'ctrlrange="{lo} {hi}" forcerange="-5 5"/>'
        )
    return "\n".join(lines)


def scene(task_bodies: str, task_sensors: str = "", camera_pos: str = "0.55 0 0.45") -> str:
    """A table-top scene: floor at z = 0 as the table, the arm, the task's bodies, one camera
    ("base_camera") looking at the workspace, and sensors for the tool point and every joint."""
    joint_sensors = "\n".join(f'<jointpos name="{j}.pos" joint="{j}"/>' for j in JOINTS)
    joint_sensors += "\n" + "\n".join(f'<jointvel name="{j}.vel" joint="{j}"/>' for j in JOINTS)
    return f"""
<mujoco model="so_arm_table">
  <compiler angle="radian"/>
  <option timestep="0.005" integrator="implicitfast"/>
  <visual><global offwidth="256" offheight="256"/></visual>
  <worldbody>
    <light pos="0.3 0 1.5" dir="0 0 -1" diffuse="0.8 0.8 0.8"/>
    <geom name="table" type="plane" size="1 1 0.05" rgba="0.55 0.45 0.35 1" {WORLD_COLLISION}/>
    <camera name="base_camera" pos="{camera_pos}" xyaxes="0 1 0 -0.6 0 0.8" fovy="60"/>
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
