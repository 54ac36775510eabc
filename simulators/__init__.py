"""Simulator adapters behind the contract (one subpackage each)."""

import os

# Offscreen MuJoCo rendering (our MuJoCo tasks, LIBERO's robosuite) needs MUJOCO_GL chosen before
# the first `import mujoco`, and ManiSkill imports mujoco too: choose it before any simulator loads.
os.environ.setdefault("MUJOCO_GL", "egl")
