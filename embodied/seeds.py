"""Reset seeds: training's, selection evaluations' and held-out evaluations', kept apart.

Training resets start at the config's ``seed`` (PPO: ``seed + i*B + b``; GRPO: per round and
group, embodied/grpo.py) and must stay below ``EVAL_SEED_OFFSET``. Selection evaluations (the
periodic ones, which pick the best checkpoint, and the one before RL) reset episode i with
``EVAL_SEED_OFFSET + seed + i``; held-out ones (the final evaluation, ``embodied eval``,
``embodied bench``, the twin's scenes in ``embodied deploy``) add ``HELD_OUT_SEED_OFFSET``, so a
checkpoint is never scored again on the episodes it was chosen on (docs/design-notes.md 45).
LIBERO is the exception: its episode is initial state seed % 50 and both offsets are multiples of
50, so its held-out evaluations run the selection's episodes (``SimulatorConfig.no_held_out``).
"""

from __future__ import annotations

from embodied.schema import UserError

# both offsets are multiples of 50: LIBERO starts seed s from initial state s % 50, so episode i
# of seed 0 stays initial state i (its published protocol)
EVAL_SEED_OFFSET = 2_000_000_000  # selection evaluations: above every training reset seed
HELD_OUT_SEED_OFFSET = 1_000_000_000  # held-out evaluations: further on from the selection ones
MAX_SEED = 100_000_000  # a config's seed is in [0, MAX_SEED): every reset seed stays < 2**32


def check_seed(key: str, seed: int) -> None:
    """A UserError (a ValueError: a config's ``validate`` names its key) ``"<key>: ..."`` unless
    ``seed`` is in [0, MAX_SEED)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise UserError(f"{key}: must be an integer in [0, {MAX_SEED:_}), got {seed!r}")


def eval_seed(seed: int, *, held_out: bool) -> int:
    """The reset seed of episode 0 of an evaluation at the config's ``seed``; episode i's is this
    plus i. ``held_out``: an evaluation that reports a result (final, eval, bench), on episodes
    that no selection evaluation ran; else a selection one (periodic, before RL). Seeds s and
    s + 1 share all but one episode: independent evaluations take seeds ``episodes`` apart."""
    return EVAL_SEED_OFFSET + seed + (HELD_OUT_SEED_OFFSET if held_out else 0)


def largest_training_seed(algorithm, round_steps: int, total_env_steps: int) -> int:
    """The largest reset seed ``algorithm`` (PPO, GRPO: its ``plan``) gives in a run of
    ``total_env_steps``: its last iteration's last round. An iteration takes at least one round
    of ``round_steps`` env steps and starts while the budget is not spent, so there are at most
    ceil(total / round_steps) of them, numbered from 1."""
    iterations = -(-total_env_steps // round_steps)
    plan = algorithm.plan(iterations, algorithm.max_rounds - 1, 0)
    if isinstance(plan.seeds, int):  # env b gets seeds + b
        return plan.seeds + len(plan.group_of_env) - 1
    return max(plan.seeds)


def check_training_seeds(largest: int) -> None:
    """A UserError ``"seed: ..."`` if a training reset seed as large as ``largest`` would reach
    the evaluation seeds."""
    if largest >= EVAL_SEED_OFFSET:
        raise UserError(
            f"seed: training's reset seeds would reach {largest:_}, into the evaluation seeds "
            f"(from {EVAL_SEED_OFFSET:_}); lower runner.total_env_steps or the seed"
        )
