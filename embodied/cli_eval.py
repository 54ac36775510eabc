"""``embodied eval CHECKPOINT``: the checkpoint's policy in the environment it was trained in
(or that env.* overrides change), deterministic actions on the held-out seeds (on LIBERO the
suite's 50 fixed initial states, which are not held out: ``made_from.held_out``); each task apart
for a multi-task checkpoint. The result, with what produced it, goes to CHECKPOINT/eval.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from embodied.cli_errors import error as _error
from embodied.logger import write_atomic


def cmd_eval(args) -> int:
    from embodied import numerics
    from embodied.checkpoint import load_policy_checkpoint
    from embodied.multitask import make_env
    from embodied.schema import check_distinct_episodes
    from embodied.seeds import check_seed

    check_seed("--seed", args.seed)  # (a UserError: one line)
    if args.episodes < 1:
        return _error(f"--episodes: must be >= 1, got {args.episodes}")
    if args.num_envs is not None and args.num_envs < 1:
        return _error(f"--num-envs: must be >= 1, got {args.num_envs}")
    try:
        ckpt = load_policy_checkpoint(args.checkpoint)
    except FileNotFoundError as e:
        return _error(str(e))
    cfg = _eval_config(args, ckpt)  # (ConfigError, UserError: one line, from main)
    try:
        check_distinct_episodes(cfg.env, {"--episodes": args.episodes})
    except ValueError as e:
        return _error(str(e))
    if cfg.runner.deterministic:  # the run's floats again, on any CPU
        numerics.restart_pinned(True, getattr(args, "restartable", False))
        numerics.pin()
    numerics.setup(cfg.runner.torch_threads)
    env = make_env(cfg.env)
    try:
        policy = _policy(args, ckpt, cfg, env)
        record = _evaluate(args, ckpt, cfg, env, policy)
    finally:
        env.close()
    print(json.dumps(record, indent=2))  # (first: the result stands whatever the disk does)
    return _keep(record, ckpt["path"])


def _keep(record: dict, checkpoint: Path) -> int:
    """``record`` written to CHECKPOINT/eval.json: 0, or 1 and one line where it cannot be (a
    run that trains on pruned the checkpoint meanwhile, a read-only disk)."""
    from embodied.checkpoint import META

    path = checkpoint / "eval.json"
    if not (checkpoint / META).is_file():  # (writing would make a checkpoint of one file)
        for video in checkpoint.glob("eval_*.mp4"):  # (--video made the directory again)
            video.unlink()
        if checkpoint.is_dir() and not any(checkpoint.iterdir()):
            checkpoint.rmdir()
        _error(f"{checkpoint} is gone (its run pruned it?): the result above is not kept")
        return 1
    try:
        write_atomic(path, json.dumps(record, indent=2))
    except OSError as e:
        _error(f"cannot write {path} ({e.strerror or e}): the result above is not kept")
        return 1
    return 0


def _policy(args, ckpt: dict, cfg, env):
    """The checkpoint's policy for ``env``, in eval mode; a UserError where overrides made an
    environment it cannot act in."""
    from embodied.checkpoint import misfit_detail, weights_misfit
    from embodied.models import build_policy
    from embodied.schema import UserError

    # (without overrides too: a simulator that now orders its state otherwise, same sizes)
    _check_same_inputs(ckpt["meta"]["spec"], env.spec, args.overrides)
    policy = build_policy(env.spec, cfg.policy).to(cfg.runner.acting_device(env.device))
    try:
        policy.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # (overrides: a camera of another size, say)
        if not args.overrides:  # (a file its config names changed since: a vlm_path's model)
            raise weights_misfit(ckpt["path"], e) from None
        detail = misfit_detail(e)
        raise UserError(
            f"{' '.join(args.overrides)}: the checkpoint's weights do not fit the policy "
            f"for this environment ({detail})"
        ) from None
    return policy.eval()


def _evaluate(args, ckpt: dict, cfg, env, policy) -> dict:
    """The evaluation's summary (over every task: ``overall``, their mean at equal episodes)
    with what produced it (``made_from``) and, for several tasks, each task's (``tasks``): each
    task runs ``--episodes`` of its own, so no task's share depends on the rows' order."""
    from embodied.config import to_dict
    from embodied.evaluate import evaluate, evaluate_by_task, overall
    from embodied.seeds import eval_seed

    video = ckpt["path"] / f"eval_{args.episodes}.mp4" if args.video else None
    seed = eval_seed(args.seed, held_out=True)  # not the seeds that chose a best checkpoint
    not_held_out = getattr(cfg.env, "no_held_out", "")  # (LIBERO: the same 50 initial states)
    if not_held_out:
        print(f"note: {not_held_out} (docs/design-notes.md 45)", file=sys.stderr)
    made_from = {
        "seed": args.seed,
        "first_reset_seed": seed,  # episode i of each task: this plus i
        "held_out": not not_held_out,  # episodes no selection evaluation ran
        "episodes": args.episodes,
        "overrides": list(args.overrides),
        "checkpoint": str(ckpt["path"]),  # (RUN and RUN/last resolved: its iteration)
        "env": to_dict(cfg.env),  # simulator, backend, task(s), num_envs
    }
    if len(getattr(env, "task_ranges", [])) < 2:
        summary = evaluate(env, policy, episodes=args.episodes, seed=seed, video_path=video)
        return {**summary, "made_from": made_from}
    tasks = evaluate_by_task(env, policy, episodes=args.episodes, seed=seed, video_path=video)
    for task, r in tasks.items():
        print(f"{task}: success {r['eval/success_rate']:.2f} over {r['eval/episodes']} episodes")
    summary = overall(tasks)
    print(
        f"overall (mean over {len(tasks)} tasks): success {summary['eval/success_rate']:.2f} "
        f"over {summary['eval/episodes']} episodes"
    )
    return {**summary, "tasks": tasks, "made_from": made_from}


def _eval_config(args, ckpt: dict):
    """The config the checkpoint was trained with, its env section changed by the command line's
    env.* overrides and --num-envs; a ConfigError or UserError for a bad one."""
    from embodied.config import COMMAND_LINE, compose, parse_overrides, validate_tree
    from embodied.schema import UserError
    from embodied.train_config import TrainConfig

    not_env = [o for o in args.overrides if not o.startswith("env.")]
    if not_env:
        raise UserError(
            f"{not_env[0]}: eval overrides env.* keys only (the policy is the checkpoint's)"
        )
    trained_env = ckpt["meta"]["config"].get("env")
    simulator = trained_env.get("simulator") if isinstance(trained_env, dict) else None
    other = parse_overrides(args.overrides).get("env", {}).get("simulator", simulator)
    if simulator is not None and other != simulator:
        raise UserError(
            f"env.simulator={other}: the checkpoint was trained on {simulator}; eval runs it there "
            "(embodied bench compares simulators)"
        )
    sources = [(str(ckpt["path"]), ckpt["meta"]["config"])]
    if args.overrides:
        sources.append((COMMAND_LINE, parse_overrides(args.overrides)))
    cfg = compose(TrainConfig, sources)
    validate_tree(cfg.env, "env.", sources, files=False)
    sft_runner = ckpt["meta"].get("sft", {}).get("runner", {})
    if "runner" not in ckpt["meta"]["config"] and "torch_threads" in sft_runner:
        cfg.runner.torch_threads = sft_runner["torch_threads"]  # (SFT's, before it named them)
    if args.num_envs is not None:
        cfg.env.num_envs = args.num_envs
        try:
            cfg.env.validate()
        except ValueError as e:
            raise UserError(f"--num-envs {args.num_envs}: {e}") from None
    return cfg


def _check_same_inputs(trained: dict, spec, overrides: list[str]) -> None:
    """A UserError when the environment that ``overrides`` made gives the checkpoint's policy
    other state or cameras, or takes other actions, than it was trained with (``trained``: its
    spec, as meta.json keeps it). Privileged keys may differ between tasks: the policy's encoder
    names any it reads and the environment lacks."""
    from embodied.schema import EnvSpec, UserError

    changes = EnvSpec.from_dict(trained).input_changes(spec)
    if changes and not overrides:
        raise UserError(
            f"the policy was trained with other inputs or actions than its environment gives "
            f"now ({'; '.join(changes)}): the simulator changed since (evaluate it with the "
            "version it was trained with)"
        )
    if changes:
        raise UserError(
            f"{' '.join(overrides)}: the policy was trained with other inputs or actions "
            f"({'; '.join(changes)}); eval's overrides change how the task runs, not what the "
            "policy sees or does"
        )


def add_eval(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="evaluate a checkpoint",
        description="Evaluate CHECKPOINT with deterministic actions.",
    )
    e.add_argument("checkpoint", help="a checkpoint directory, a run directory or RUN/last")
    e.add_argument(
        "--episodes", type=int, default=50, help="number of evaluation episodes (default 50)"
    )
    e.add_argument(
        "--video", action="store_true", help="write an mp4 of the first round of episodes"
    )
    e.add_argument(
        "--seed",
        type=int,
        default=0,
        help="evaluation seed, in [0, 100000000) (default 0); episode i resets with the seed "
        "plus i, so seeds closer than --episodes share episodes",
    )
    e.add_argument(
        "--num-envs", type=int, default=None, help="environments in parallel (default: as trained)"
    )
    e.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="env.key=value: the same task another way (env.backend=warp env.device=cuda)",
    )
    e.set_defaults(func=cmd_eval)
