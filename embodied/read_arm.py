"""`embodied read-arm`: an arm's joints as LeRobot reads them, torque off, while its user moves
it by hand to check its zeros and signs against the model's (docs/so101.md)."""

from __future__ import annotations

import time

import numpy as np


def arm_robot(arm):
    """LeRobot's driver object for ``arm`` (ArmConfig), not connected: the real arm's, or the
    twin's for ``-sim`` robots."""
    if not arm.robot.endswith("-sim"):
        from embodied.robots.arm import make_robot

        return make_robot(arm)
    from embodied.twin import make_twin_robot

    return make_twin_robot(arm)[0]


def read_arm(robot, arm, *, readings: int | None, hz: float = 5.0, write=print) -> int:
    """Open ``robot``'s bus (LeRobot's driver, for ``arm``) with its calibration, switch its
    torque off and write its joints ``readings`` times at ``hz`` (None: until Ctrl-C), for a
    user moving it by hand to check its zeros and signs against the model's (docs/so101.md):
    degrees as LeRobot reads them, the gripper also in the model's radians. The servos are not
    configured (no torque on, no cameras opened). -> readings written."""
    from embodied.robots.arm import cannot_connect, from_radians, read_joints, uncalibrated

    bus = robot.bus
    try:
        bus.connect()
    except Exception as e:
        raise cannot_connect(arm, e) from e
    written = 0
    torque_off = False
    try:
        if not bus.is_calibrated:
            raise uncalibrated(robot, arm)
        write("torque off: hold the arm, then move it by hand (Ctrl-C ends)")
        bus.disable_torque(num_retry=3)
        torque_off = True
        while readings is None or written < readings:
            if written:
                time.sleep(1.0 / hz)
            joints = read_joints(robot, arm)  # f64 [6]: radians, the arm's frame
            write(_readings_line(joints, from_radians(joints, arm.gripper_range)["gripper.pos"]))
            written += 1
    except KeyboardInterrupt:
        pass
    except Exception as e:
        if not torque_off:
            e.add_note("the servos' torque may still be on")
        raise
    finally:
        bus.disconnect(disable_torque=False)
    return written


def _readings_line(joints: np.ndarray, gripper_value: float) -> str:
    from embodied.robots.arm import JOINTS

    arm_joints = "  ".join(f"{j} {np.degrees(q):+7.1f}" for j, q in zip(JOINTS[:-1], joints))
    return f"{arm_joints}  gripper {gripper_value:5.1f} ({joints[-1]:+.3f} rad)"
