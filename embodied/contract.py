"""Validators of the contract in ``embodied.schema``: ``check_env`` and ``check_policy``.

Both raise ``ContractError`` with a message naming the offending key, shape, dtype or device, and
return a small report on success. Contract tests run them over every registered simulator,
robot and policy.
"""

from __future__ import annotations

import torch

from embodied import schema as S


class ContractError(AssertionError):
    pass


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ContractError(msg)


def _check_tensor(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    _require(
        isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}"
    )
    _require(t.dtype == dtype, f"{name}: dtype {t.dtype}, expected {dtype}")
    _require(
        tuple(t.shape) == tuple(shape), f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}"
    )
    _require(
        same_device(t.device, torch.device(device)), f"{name}: on {t.device}, expected {device}"
    )


def same_device(actual: torch.device, expected: torch.device) -> bool:
    """A tensor on ``actual`` is on ``expected``: the same type and index (cuda:1 is not cuda:0);
    ``expected`` without an index ("cuda") means the current device of its type."""
    if actual.type != expected.type:
        return False
    if expected.index is None and expected.type == "cuda":
        return actual.index == torch.cuda.current_device()
    return expected.index is None or actual.index == expected.index


def check_observation(
    obs, spec: S.EnvSpec, batch: int, device: torch.device, where: str = "obs"
) -> None:
    _require(
        isinstance(obs, S.Observation), f"{where}: expected Observation, got {type(obs).__name__}"
    )
    _check_tensor(f"{where}.state", obs.state, (batch, spec.obs.state_dim), torch.float32, device)
    _require(bool(torch.isfinite(obs.state).all()), f"{where}.state has non-finite values")
    cams = {c.name: c for c in spec.obs.cameras}
    _require(
        set(obs.images) == set(cams),
        f"{where}.images keys {sorted(obs.images)} != spec cameras {sorted(cams)}",
    )
    for name, cam in cams.items():
        _check_tensor(
            f"{where}.images[{name!r}]",
            obs.images[name],
            (batch, cam.height, cam.width, 3),
            torch.uint8,
            device,
        )
    _require(
        set(obs.privileged) == set(spec.obs.privileged),
        f"{where}.privileged keys {sorted(obs.privileged)} != spec {sorted(spec.obs.privileged)}",
    )
    for key, shape in spec.obs.privileged.items():
        _check_tensor(
            f"{where}.privileged[{key!r}]",
            obs.privileged[key],
            (batch, *shape),
            torch.float32,
            device,
        )
    _require(
        isinstance(obs.instruction, list)
        and len(obs.instruction) == batch
        and all(isinstance(s, str) for s in obs.instruction),
        f"{where}.instruction: expected list[str] of length {batch}",
    )


def _random_actions(
    spec: S.ActionSpec, batch: int, device, generator: torch.Generator
) -> torch.Tensor:
    low, high = spec.bounds(device)
    u = torch.rand(batch, spec.dim, generator=generator).to(device)
    return low + u * (high - low)  # float32 [B, A]


def check_env(
    env, *, seed: int = 0, deterministic: bool = True, max_steps: int | None = None
) -> dict:
    """Validate a VecEnv: spec, observation keys/shapes/dtypes/devices (the device's index too),
    seeded and partial reset, step outputs, auto-reset with ``final_obs`` and truncation at
    exactly ``max_episode_steps``.

    ``deterministic``: the env resets to seeded start states (a simulator; not a physical scene,
    which starts where it stands), so a partial reset must give its row what a full reset with
    that seed gives it, and ``final_obs`` of an ended row whose observation moved during its
    episode must differ from the row's new start."""
    _require(
        isinstance(env, S.VecEnv), f"{type(env).__name__} does not implement the VecEnv protocol"
    )
    spec = env.spec
    B = env.num_envs
    dev = torch.device(env.device)
    _require(isinstance(spec, S.EnvSpec), "env.spec must be an EnvSpec")
    _require(spec.max_episode_steps > 0, "spec.max_episode_steps must be positive")
    obs = env.reset(seed=seed)
    check_observation(obs, spec, B, dev, "reset()")
    if deterministic:
        _check_seeded_resets(env, obs, seed)
    _check_partial_reset(env, seed, deterministic)
    limit = max_steps or spec.max_episode_steps + 1
    _check_episodes(env, seed, limit, deterministic)
    _check_render(env, B)
    return {"num_envs": B, "device": str(dev), "steps": limit}


def _check_render(env, B: int) -> None:
    """render() gives uint8 [B, H, W, 3] (or None); render(ids) gives those rows in ids' order."""
    frame = env.render()
    if frame is None:
        return
    _require(
        frame.dtype == torch.uint8
        and frame.dim() == 4
        and frame.shape[0] == B
        and frame.shape[-1] == 3,
        f"render(): expected uint8 [B, H, W, 3], got {frame.dtype} {tuple(frame.shape)}",
    )
    ids = torch.tensor([min(2, B - 1), 0][: min(B, 2)])  # long [<=2]: out of order where B > 1
    rows = env.render(ids)
    _require(
        rows is not None and torch.equal(rows.cpu(), frame[ids.to(frame.device)].cpu()),
        f"render(env_ids={ids.tolist()}) is not render()'s rows {ids.tolist()}",
    )


def _check_seeded_resets(env, obs: S.Observation, seed: int) -> None:
    """The same seed gives the same states (``obs``: a reset with ``seed``); one seed for every
    environment gives one state in every row (GRPO groups rely on it)."""
    again = env.reset(seed=seed)
    _require(torch.equal(obs.state, again.state), "reset(seed=s) twice gave different states")
    for k in obs.privileged:
        _require(
            torch.allclose(obs.privileged[k], again.privileged[k]),
            f"reset(seed=s) twice: privileged[{k!r}] differs",
        )
    same = env.reset(seed=[seed + 1] * env.num_envs)
    _require(
        torch.allclose(same.state, same.state[:1].expand_as(same.state), atol=1e-5),
        "reset(seed=[s]*B): state differs across envs",
    )
    for k, v in same.privileged.items():
        _require(
            torch.allclose(v, v[:1].expand_as(v), atol=1e-5),
            f"reset(seed=[s]*B): privileged[{k!r}] differs across envs",
        )


def _check_partial_reset(env, seed: int, deterministic: bool) -> None:
    """Env 0 reset alone with ``seed + 100`` after a step: the full batch comes back, the other
    rows as the step left them, and (``deterministic``) row 0 as a full ``reset(seed=seed +
    100)`` gives it (so a partial reset that resets nothing, or the wrong row, is caught): state,
    privileged and, for the other rows, images."""
    B = env.num_envs
    dev = torch.device(env.device)
    fresh = env.reset(seed=seed + 100) if deterministic else None  # env 0's seed: seed + 100
    env.reset(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    stepped = env.step(_random_actions(env.spec.action, B, dev, gen)).obs
    # (a copy: a renderer's images may be views of a buffer the reset draws over)
    stepped = stepped.map(torch.clone)
    part = env.reset(seed=seed + 100, env_ids=torch.tensor([0], device=dev))
    check_observation(part, env.spec, B, dev, "reset(env_ids=[0])")
    if B > 1:
        _require(
            not _rows_differ(part, stepped)[1:].any(),
            "partial reset changed environments it was not asked to reset",
        )
    if fresh is not None:
        _require(
            not _rows_differ(part, fresh, atol=1e-5, images=False)[0],
            f"reset(seed={seed + 100}, env_ids=[0]) gave env 0 another start than "
            f"reset(seed={seed + 100}) gives it",
        )


def _rows_differ(
    a: S.Observation, b: S.Observation, atol: float = 0.0, images: bool = True
) -> torch.Tensor:
    """bool [B] on the CPU: the rows where ``a`` and ``b`` differ (state, privileged or, with
    ``images``, images; by more than ``atol``)."""
    differ = torch.zeros(a.batch_size, dtype=torch.bool)
    pairs = [(a.state, b.state)]
    pairs += [(a.privileged[k], b.privileged[k]) for k in a.privileged]
    pairs += [(a.images[k], b.images[k]) for k in a.images] if images else []
    for x, y in pairs:
        gap = (x.float() - y.float()).abs().reshape(len(x), -1)  # f32 [B, D]
        differ |= (gap > atol).any(1).cpu()
    return differ


def _check_episodes(env, seed: int, limit: int, deterministic: bool) -> None:
    """``limit`` steps of random actions from a reset with ``seed``: each step's outputs, and
    episodes that end (some must), truncated at exactly ``max_episode_steps``, with their
    ``final_obs``."""
    spec = env.spec
    B = env.num_envs
    dev = torch.device(env.device)
    start = env.reset(seed=seed)  # each row's episode's first observation
    gen = torch.Generator().manual_seed(seed)
    ended_any = False
    lengths = torch.zeros(B, dtype=torch.long)  # long [B]
    moved = torch.zeros(B, dtype=torch.bool)  # the row's observation changed in its episode
    for t in range(limit):
        out = env.step(_random_actions(spec.action, B, dev, gen))
        _require(
            isinstance(out, S.StepOutput), f"step(): expected StepOutput, got {type(out).__name__}"
        )
        check_observation(out.obs, spec, B, dev, f"step({t}).obs")
        _check_tensor(f"step({t}).reward", out.reward, (B,), torch.float32, dev)
        for name in ("terminated", "truncated", "success"):
            _check_tensor(f"step({t}).{name}", getattr(out, name), (B,), torch.bool, dev)
        done = (out.terminated | out.truncated).cpu()
        lengths += 1
        _require(
            bool((lengths <= spec.max_episode_steps).all()),
            f"an episode ran past max_episode_steps={spec.max_episode_steps} without truncation",
        )
        early = out.truncated.cpu() & (lengths != spec.max_episode_steps)
        _require(
            not early.any(),
            f"step({t}): truncated after {lengths[early].tolist()} steps, not at "
            f"max_episode_steps={spec.max_episode_steps}",
        )
        if done.any():
            ended_any = True
            _check_ended(out, done, spec, dev, t, moved if deterministic else None)
            lengths[done] = 0
            moved[done] = False
            start = out.obs.where(done.to(dev), start)
        else:
            _require(out.final_obs is None, f"step({t}): final_obs given although no episode ended")
            _require(out.ended is None, f"step({t}): ended given although no episode ended")
        moved |= _rows_differ(out.obs, start) & ~done
    _require(
        ended_any,
        f"no episode ended within {limit} steps (max_episode_steps={spec.max_episode_steps})",
    )


def _check_ended(
    out: S.StepOutput,
    done: torch.Tensor,
    spec: S.EnvSpec,
    dev: torch.device,
    t: int,
    moved: torch.Tensor | None,
) -> None:
    """Step ``t``, where the rows of ``done`` (bool [B], CPU) ended: ``ended`` names them, and
    ``final_obs`` is the full batch, equal to ``obs`` in the rows still running and, in the
    ended rows whose observation ``moved`` (bool [B]; None: not checked) during their episode,
    not the new episode's first observation."""
    B = done.shape[0]
    _require(out.final_obs is not None, f"step({t}): episodes ended but final_obs is None")
    rows = done.nonzero().squeeze(1)
    _require(
        isinstance(out.ended, torch.Tensor)
        and out.ended.device.type == "cpu"
        and out.ended.dtype == torch.long
        and torch.equal(out.ended, rows),
        f"step({t}).ended: expected long {rows.tolist()} on the CPU, got {out.ended}",
    )
    check_observation(out.final_obs, spec, B, dev, f"step({t}).final_obs")
    keep = ~done
    if keep.any():
        k = keep.to(dev)
        _require(
            torch.equal(out.final_obs.state[k], out.obs.state[k]),
            "final_obs rows of running envs must equal obs",
        )
    if moved is not None:
        stale = done & moved & ~_rows_differ(out.final_obs, out.obs)
        _require(
            not stale.any(),
            f"step({t}): final_obs of ended envs {stale.nonzero()[:, 0].tolist()} is their new "
            "episode's first observation, not the last one before the automatic reset",
        )


def random_observation(spec: S.EnvSpec, batch: int, device="cpu", seed: int = 0) -> S.Observation:
    """A synthetic observation that satisfies ``spec`` (for policy checks without a simulator)."""
    g = torch.Generator().manual_seed(seed)
    return S.Observation(
        state=torch.randn(batch, spec.obs.state_dim, generator=g).to(device),
        instruction=[
            spec.instructions[i % len(spec.instructions)] if spec.instructions else ""
            for i in range(batch)
        ],
        images={
            c.name: torch.randint(
                0, 256, (batch, c.height, c.width, 3), generator=g, dtype=torch.uint8
            ).to(device)
            for c in spec.obs.cameras
        },
        privileged={
            k: torch.randn(batch, *shape, generator=g).to(device)
            for k, shape in spec.obs.privileged.items()
        },
    )


def check_policy(
    policy, spec: S.EnvSpec, *, batch_size: int = 3, device="cpu", atol: float = 1e-5
) -> dict:
    """Validate a Policy: output shapes/dtypes, actions within bounds, deterministic mode,
    log-probabilities per action dimension (``extras['logp_token']``) and ``evaluate`` at the
    chunk, action and token levels reproducing ``act``'s, and gradients reaching the weights."""
    _require(
        isinstance(policy, S.Policy),
        f"{type(policy).__name__} does not implement the Policy protocol",
    )
    obs = random_observation(spec, batch_size, device)
    out = _check_act(policy, obs, spec, device, atol)
    logprob, value, err = _check_evaluate(policy, obs, out, device, atol)
    params = (
        [p for p in policy.parameters() if p.requires_grad] if hasattr(policy, "parameters") else []
    )
    if params:
        loss = logprob.sum() + (value.sum() if value is not None else 0.0)
        _require(
            loss.requires_grad, "no gradient reaches the policy's weights: evaluate() is detached"
        )
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        _require(
            any(g is not None and g.abs().sum() > 0 for g in grads),
            "no gradient reaches the policy's weights",
        )
    return {"chunk": out.actions.shape[1], "logprob_error": err}


def _check_act(policy, obs: S.Observation, spec: S.EnvSpec, device, atol: float):
    """``act``'s output (shapes, dtypes, bounds, log-probabilities per dimension that sum to the
    chunk's) and its deterministic mode; returns the sampled output."""
    B = obs.batch_size
    A = spec.action.dim
    with torch.no_grad():
        out = policy.act(obs)
    _require(
        isinstance(out, S.PolicyOutput), f"act(): expected PolicyOutput, got {type(out).__name__}"
    )
    _require(
        out.actions.dim() == 3 and out.actions.shape[0] == B and out.actions.shape[2] == A,
        f"act().actions: shape {tuple(out.actions.shape)}, expected [B={B}, K, A={A}]",
    )
    K = out.actions.shape[1]
    _check_tensor("act().actions", out.actions, (B, K, A), torch.float32, device)
    low, high = spec.action.bounds(device)
    _require(
        bool(((out.actions >= low - 1e-6) & (out.actions <= high + 1e-6)).all()),
        "act().actions outside ActionSpec bounds",
    )
    _check_tensor("act().logprob", out.logprob, (B,), torch.float32, device)
    _require(bool(torch.isfinite(out.logprob).all()), "act().logprob is not finite")
    if out.value is not None:
        _check_tensor("act().value", out.value, (B,), torch.float32, device)
    with torch.no_grad():
        d1 = policy.act(obs, deterministic=True)
        d2 = policy.act(obs, deterministic=True)
    _require(torch.equal(d1.actions, d2.actions), "act(deterministic=True) is not deterministic")
    token = out.extras.get("logp_token")
    _require(token is not None, "act().extras['logp_token'] missing (f32 [B, K, A])")
    _check_tensor("act().extras['logp_token']", token, (B, K, A), torch.float32, device)
    token_err = (token.sum((1, 2)) - out.logprob).abs().max().item()
    _require(
        token_err <= atol, f"act(): logp_token does not sum to logprob (off by {token_err:.2e})"
    )
    return out


def _check_evaluate(policy, obs: S.Observation, out: S.PolicyOutput, device, atol: float):
    """``evaluate`` at every level, and its chunk log-probability against ``act``'s: returns
    (log-probability f32 [B] with its graph, value or None, the largest difference)."""
    B, K, A = out.actions.shape
    shapes = {"chunk": (B,), "action": (B, K), "token": (B, K, A)}
    for level, shape in shapes.items():
        at_level, ent, value = policy.evaluate(obs, out, level=level)
        _check_tensor(f"evaluate(level={level!r})", at_level, shape, torch.float32, device)
    logprob, ent, value = policy.evaluate(obs, out, level="chunk")
    _check_tensor("evaluate().entropy", ent, (B,), torch.float32, device)
    err = (logprob.detach() - out.logprob).abs().max().item()
    _require(
        err <= atol, f"evaluate() log-probability differs from act()'s by {err:.2e} (> {atol})"
    )
    if value is not None:
        _check_tensor("evaluate().value", value, (B,), torch.float32, device)
    return logprob, value, err
