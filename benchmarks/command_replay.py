"""The simulator alone under the collect phase's own commands: raw physics, like for like.

The throughput benchmark's raw loop holds uniform random servo targets and never resets, while
the collect phase moves the targets by the policy's deltas and resets worlds as episodes end.
The two ask the physics for different work: on Warp's CPU device (push, 4096 worlds, 80 steps)
the solver ran 7.21 iterations a substep in the slowest world under the collect phase's
commands, against 6.90 under raw's (docs/benchmarks.md), and on a GPU MuJoCo Warp's solver loop
runs until the slowest world converges. Replaying the collect phase's commands gives the
physics of that very trajectory without anything else: no observation, reward, policy or
buffer, and a reset costs only the copy of the recorded state.

- ``record``: run a loop of the MuJoCo Warp backend's collect phase once (untimed), keeping
  every step's servo targets and the state of all worlds at its start and after each reset;
- ``restore``: write a recorded state back (the replay's start, and its steps with resets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# What MuJoCo Warp's step reads from the last one (MuJoCo's integration state, less the
# controls, which are replayed step by step): the rest it derives anew. The same fields as
# MuJoCo Warp's get_state/set_state, copied by torch here: their Warp kernels would compile
# anew, outside the carried kernel cache, on a GPU visit whose minutes are counted
STATE_FIELDS = (
    "time",
    "qpos",
    "qvel",
    "act",
    "qacc_warmstart",
    "qfrc_applied",
    "xfrc_applied",
    "mocap_pos",
    "mocap_quat",
    "eq_active",
)


@dataclass
class Recorded:
    """The physics' inputs of one run of the collect phase, all on the env's device."""

    start: dict[str, torch.Tensor]  # field -> every world's state before the first step
    targets: torch.Tensor  # f32 [T, B, nu]: the servo targets held during each step's physics
    restores: dict[int, dict[str, torch.Tensor]]  # step -> the state after that step's resets


def state(env) -> dict[str, torch.Tensor]:
    """A copy of the integration state of every world of a MuJoCo Warp env."""
    fields = (env._wp.to_torch(getattr(env._d, name)) for name in STATE_FIELDS)
    return {name: t.clone() for name, t in zip(STATE_FIELDS, fields) if t.numel()}


def restore(env, saved: dict[str, torch.Tensor]) -> None:
    """Write a state from ``state`` back into the env's worlds (in place, the views stay)."""
    for name, value in saved.items():
        env._wp.to_torch(getattr(env._d, name)).copy_(value)


def record(env, prepare, run, steps: int) -> Recorded:
    """Run ``prepare()`` then ``run(steps)`` of the collect phase on ``env`` (a MuJoCo Warp
    env), keeping what its physics was given. Not with per-world randomisation: a reset also
    writes model fields, which a replay does not restore."""
    if env.cfg.randomize.active:
        raise ValueError("a replay restores states, not randomised model fields: randomize off")
    prepare()
    start = state(env)
    targets: list[torch.Tensor] = []
    restores: dict[int, dict[str, torch.Tensor]] = {}
    physics = env._physics
    reset_rows = env._reset_rows

    def recording_physics() -> None:
        targets.append(env._ctrl.clone())
        physics()

    def recording_reset(rows) -> None:
        reset_rows(rows)
        restores[len(targets) - 1] = state(env)

    env._physics = recording_physics
    env._reset_rows = recording_reset
    try:
        run(steps)
    finally:
        del env._physics, env._reset_rows  # instance attributes: the class's methods again
    return Recorded(start, torch.stack(targets), restores)


def replay(env, recorded: Recorded, steps: int, render: bool = False) -> None:
    """``steps`` steps of the recorded run's physics from where it stands (its start after
    ``restore(env, recorded.start)``): the targets copied in, the resets as recorded states;
    ``render``: the cameras too, as an rgb observation costs."""
    for t in range(steps):
        env._ctrl.copy_(recorded.targets[t])
        env._physics()
        if render:
            env._images()
        saved = recorded.restores.get(t)
        if saved is not None:
            restore(env, saved)
