"""What a deploy asks of a checkpoint, and how its policy's chunks become arm commands.

A deployable checkpoint's policy reads only what an arm measures (joints, cameras) plus a goal its
user may give; ``contract`` is what a policy server and its client must agree on; the wire format
carries observations to a server; ``RobotInfer`` turns a chunk into joint targets, joint deltas
added as the simulator the policy was trained in adds them: to its last target (MuJoCo), or to the
joints as measured at the step (ManiSkill's pd_joint_delta_pos: ``deltas_from`` "measured").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from embodied.schema import EnvSpec, Observation, UserError, check_device_name, checked_device


class DeployError(ValueError):
    pass


def serve_device(name: str) -> torch.device:
    """``--device`` of ``embodied serve`` as a torch device: auto is cuda where this machine has
    it, else cpu; CUDA asked for on a machine without it is a one-line UserError."""
    try:
        check_device_name("--device", name, auto=True)
    except ValueError as e:
        raise UserError(str(e)) from None
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return checked_device("--device", name, "--device cpu (or auto)")


def load_deployable(checkpoint: str | Path, device: torch.device | str = "cpu", build=True):
    """(policy in eval mode on ``device``, its EnvSpec, contract dict, the config it was trained
    with) of a checkpoint. ``build=False``: no policy (None), for a deploy whose policy server
    acts: its weights are not loaded there (the contract digests their files, which must be
    there), and a VLM directory it names need not be."""
    from embodied.checkpoint import read_meta, resolve_checkpoint
    from embodied.demos import load_policy, trained_config

    path = resolve_checkpoint(checkpoint)
    meta = read_meta(path, of_policy=True)
    spec = EnvSpec.from_dict(meta["spec"])
    policy, train_cfg = load_policy(path, device) if build else (None, trained_config(path, meta))
    if spec.action.deltas_from is None:
        spec = _deltas_said(spec, train_cfg)
    return policy, spec, contract(spec, path), train_cfg


def _deltas_said(spec: EnvSpec, train_cfg) -> EnvSpec:
    """The spec of a checkpoint saved before specs said what deltas add to, saying it: ManiSkill's
    delta modes other than the *_target_* ones add them to the joints as measured."""
    mode = getattr(train_cfg.env, "control_mode", None) or ""
    measured = train_cfg.env.simulator == "maniskill" and "delta" in mode and "target" not in mode
    said = "measured" if measured else "target"
    return dataclasses.replace(spec, action=dataclasses.replace(spec.action, deltas_from=said))


def contract(spec: EnvSpec, path: Path) -> dict:
    """What client and server must agree on. Normalization statistics live in the weights file, so
    its digest versions them (with the TP shards' files of a megatron checkpoint); frozen weights
    live in a file named by a digest of its content (meta.json's "frozen"), so that name
    versions them."""
    weights = hashlib.sha1((path / "model.safetensors").read_bytes())
    for file in sorted(path.glob("model-tp*.safetensors")):  # (their weights, not Adam's state)
        shard = load_file(str(file))
        for name in sorted(k for k in shard if k.startswith("weight/")):
            weights.update(name.encode())
            weights.update(shard[name].contiguous().view(-1).view(torch.uint8).numpy())
    frozen = json.loads((path / "meta.json").read_text()).get("frozen")
    if frozen:  # older checkpoints, and models with nothing frozen, have none
        weights.update(frozen.encode())
    agreed = {
        "action": spec.to_dict()["action"],
        "state_names": list(spec.obs.state_names),
        "cameras": [[c.name, c.height, c.width] for c in spec.obs.cameras],
        "weights": weights.hexdigest()[:16],
    }
    return json.loads(json.dumps(agreed))  # lists, not tuples: as it arrives through msgpack


GOAL = "goal_pos"  # the one privileged input an arm can have: a goal its user gives


def check_fits(reads, spec: EnvSpec, cameras, *, known: frozenset[str] = frozenset()) -> None:
    """Refuse a checkpoint whose policy reads the privileged keys ``reads`` and cannot act on an
    arm with these cameras (names) and these privileged inputs (``known``: a goal its user gives;
    on the twin whatever its simulator knows), naming every reason; it needs nothing connected,
    so it runs before anything is."""
    from embodied.robots.arm import JOINTS, STATE_NAMES

    problems = []
    if tuple(spec.action.names) != JOINTS:
        problems.append(f"actions {spec.action.names}, the arm has {JOINTS}")
    if spec.action.space not in ("joint_pos", "joint_delta"):
        problems.append(
            f"action space {spec.action.space!r} (the arm takes joint_pos or joint_delta)"
        )
    missing = [n for n in spec.obs.state_names if n not in STATE_NAMES]
    if missing:
        problems.append(f"state columns {missing} that the arm does not measure")
    need = set(reads)
    unknown = need - known - {GOAL}
    if unknown:
        problems.append(
            f"simulator-only inputs {sorted(unknown)} (train with "
            f"policy.use_privileged=false, or policy.privileged_keys=[{GOAL}])"
        )
    if GOAL in need and GOAL not in known:
        problems.append(f"the input {GOAL} (give --goal X,Y,Z: metres in the arm's base frame)")
    lacking = [c.name for c in spec.obs.cameras if c.name not in set(cameras)]
    if lacking:
        problems.append(f"cameras {lacking} (give --camera NAME=SOURCE for each)")
    if problems:
        raise DeployError("the checkpoint cannot drive this arm: " + "; ".join(problems))


def obs_to_wire(obs: Observation) -> dict:
    return {
        "state": obs.state[0].numpy(),
        "images": {k: v[0].numpy() for k, v in obs.images.items()},
        "instruction": obs.instruction[0],
        "privileged": {k: v[0].numpy() for k, v in obs.privileged.items()},  # a given goal
    }


def wire_to_obs(msg: dict, spec: EnvSpec) -> Observation:
    """A client's observation as a batch of one in the policy's column order."""
    # np.array copies: arrays decoded from msgpack are read-only views of the message
    state = torch.from_numpy(np.array(msg["state"], np.float32))[None]  # f32 [1, S]
    images = {
        k: torch.from_numpy(np.array(v, np.uint8))[None]
        for k, v in (msg.get("images") or {}).items()
    }
    if state.shape[1] != spec.obs.state_dim or set(images) != {c.name for c in spec.obs.cameras}:
        raise ValueError(
            f"observation has {state.shape[1]} state columns and cameras {sorted(images)}; "
            f"the policy needs {spec.obs.state_dim} and {[c.name for c in spec.obs.cameras]}"
        )
    privileged = {
        k: torch.from_numpy(np.array(v, np.float32))[None]
        for k, v in (msg.get("privileged") or {}).items()
    }  # f32 [1, D] each
    return Observation(
        state=state,
        instruction=[str(msg.get("instruction", ""))],
        images=images,
        privileged=privileged,
    )


def policy_chunk(policy, obs: Observation) -> np.ndarray:
    """float32 [K, A] in the policy's own action space (on the host)."""
    with torch.no_grad():
        return policy.act(obs, deterministic=True).actions[0].float().cpu().numpy()


def select_columns(obs: Observation, spec: EnvSpec, robot_spec: EnvSpec) -> Observation:
    cols = [robot_spec.obs.state_names.index(n) for n in spec.obs.state_names]
    return Observation(
        state=obs.state[:, cols],
        instruction=obs.instruction,
        images={c.name: obs.images[c.name] for c in spec.obs.cameras},
        privileged=dict(obs.privileged),
    )


class RobotInfer:
    """The control loop's ``infer``: (obs, base) -> float64 [K, 6] joint targets (radians, the
    policy's frame), the policy's chunk with deltas (joint_delta) accumulated from ``base``.
    ``prepare(obs)`` takes ``base`` on the control loop's thread when the chunk is asked for: the
    last command before that step's (read on the inference thread, it was the step's own or not,
    by the threads' timing). Deltas from the joints as measured stay deltas in the plan, and
    ``command`` adds each to the arm's pose as its step reads it (a blocked joint's target stays
    a step from where it is, as in the simulator, instead of winding up to its limit)."""

    def __init__(self, chunk_of, spec: EnvSpec, env):
        self.chunk_of = chunk_of
        self.spec = spec
        self.env = env
        action = spec.action
        self.measured = action.space == "joint_delta" and action.deltas_from == "measured"

    def prepare(self, obs: Observation) -> tuple[Observation, np.ndarray]:
        return obs, self.env.to_policy(self.env.safety.last)

    def __call__(self, request: tuple[Observation, np.ndarray]) -> np.ndarray:
        obs, base = request
        chunk = self.chunk_of(select_columns(obs, self.spec, self.env.spec))
        chunk = np.asarray(chunk, np.float64)
        if self.spec.action.space != "joint_delta" or self.measured:
            return chunk
        return accumulate(base, chunk, self.spec, self.env.spec)

    def command(self, planned: np.ndarray) -> np.ndarray:
        """The joint targets (f64 [6]) sent for a planned action: a delta from the joints as
        measured added to the arm's present pose (read with this step's observation)."""
        if not self.measured:
            return planned
        present = self.env.to_policy(self.env.present)
        delta = np.asarray(planned, np.float64)[None]  # f64 [1, 6]
        return accumulate(present, delta, self.spec, self.env.spec)[0]


def accumulate(base: np.ndarray, deltas: np.ndarray, spec: EnvSpec, arm: EnvSpec) -> np.ndarray:
    """The targets (f64 [K, 6]) that joint deltas (f64 [K, 6]) lead to from ``base`` (f64 [6]),
    as a simulator steps them: each delta within the policy's action bounds, each target within
    the arm's joint range (``arm.action``'s bounds, the policy's frame). Summed unclipped, a
    policy that pushes against a limit would build up a debt it must undo before moving back.
    From a delta that is not finite on, every target is NaN: the safety layer rejects those
    whole (a clip would make an infinity the largest step, a full-speed move)."""
    step_low = np.asarray(spec.action.low, np.float64)  # f64 [6]
    step_high = np.asarray(spec.action.high, np.float64)
    joint_low = np.asarray(arm.action.low, np.float64)  # f64 [6]
    joint_high = np.asarray(arm.action.high, np.float64)
    targets = np.empty_like(deltas)  # f64 [K, 6]
    target = np.asarray(base, np.float64)
    for k, delta in enumerate(deltas):  # each step starts where the last one was clipped to
        if not np.isfinite(delta).all():
            targets[k:] = np.nan
            break
        target = np.clip(target + np.clip(delta, step_low, step_high), joint_low, joint_high)
        targets[k] = target
    return targets
