"""``embodied`` command line: train, eval, demos, sft, bench, serve, deploy, cluster, convert,
replay, episodes, report.

A user error (a bad config key, path, task, checkpoint or option) is one line on stderr,
``embodied: error: <what, naming the culprit>``, and exit code 2: ``ConfigError``,
``embodied.schema.UserError`` and the errors each command names. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from embodied.cli_errors import error as _error
from embodied.cli_errors import file_in_the_way


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (``embodied: error: ...``, exit code 2)."""

    def error(self, message: str):
        _error(f"{message} (see {self.prog} --help)")
        sys.exit(2)


def _schema(command: str) -> type:
    """The config schema of a CONFIG command."""
    if command == "train":
        from embodied.train_config import TrainConfig

        return TrainConfig
    if command == "sft":
        from embodied.sft import SFTConfig

        return SFTConfig
    if command == "demos":
        from embodied.demos import DemosConfig

        return DemosConfig
    from embodied.bench import BenchConfig

    return BenchConfig


def check_config(args, *, files: bool = True):
    """The config of a CONFIG command (train, sft, demos, bench), checked as the command checks it
    before building anything: keys and values, the sections against each other, and the tasks its
    simulators know (a bench suite's every task); ``files``: also the local files a schema checks
    before the run (a model directory). Raises ConfigError or UserError, one line each."""
    from embodied.bench import expand
    from embodied.config import load_config, source_of
    from embodied.multitask import check_tasks

    cfg, sources = load_config(_schema(args.command), args.config, args.overrides, files=files)
    if args.command == "bench":
        expand(cfg, source_of("tasks", sources))  # (the file, or tasks=[...] on the command line)
    elif args.command != "sft":  # (SFT's tasks are its datasets')
        check_tasks(cfg.env)
    return cfg


def _pinned(args, deterministic: bool) -> None:
    from embodied.numerics import restart_pinned

    restart_pinned(deterministic, getattr(args, "restartable", False))


def _load(args):
    """The config of a CONFIG [overrides] command, or None after printing its one-line error."""
    from embodied.config import ConfigError
    from embodied.schema import UserError

    try:
        return check_config(args)
    except (ConfigError, UserError) as e:
        _error(str(e))
        return None


def cmd_train(args) -> int:
    from embodied.config import ConfigError
    from embodied.roles import WorkerLost
    from embodied.run import Stopped
    from embodied.runner import train

    if (cfg := _load(args)) is None:
        return 2
    _pinned(args, cfg.runner.deterministic)
    try:
        train(cfg)
    except ConfigError as e:
        return _error(str(e))
    except Stopped as e:
        print(f"embodied: {e}", file=sys.stderr)
        return 128 + e.signum
    except WorkerLost as e:  # a cluster role that kept failing: the last checkpoint resumes
        print(
            f"embodied: error: {e}; resume with runner.resume={cfg.runner.output_dir}/"
            f"{cfg.runner.name}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_eval(args) -> int:
    from embodied import numerics
    from embodied.checkpoint import load_policy_checkpoint
    from embodied.evaluate import evaluate
    from embodied.models import build_policy
    from embodied.multitask import make_env
    from embodied.schema import UserError
    from embodied.seeds import check_seed, eval_seed

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
    if cfg.runner.deterministic:  # the run's floats again, on any CPU
        _pinned(args, True)
        numerics.pin()
    numerics.setup(cfg.runner.torch_threads)
    env = make_env(cfg.env)
    try:
        if args.overrides:
            _check_same_inputs(ckpt["meta"]["spec"], env.spec, args.overrides)
        policy = build_policy(env.spec, cfg.policy).to(env.device)
        try:
            policy.load_state_dict(ckpt["model"])
        except RuntimeError as e:  # (overrides: a camera of another size, say)
            if not args.overrides:
                raise
            detail = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
            raise UserError(
                f"{' '.join(args.overrides)}: the checkpoint's weights do not fit the policy "
                f"for this environment ({detail})"
            ) from None
        policy.eval()
        video = ckpt["path"] / f"eval_{args.episodes}.mp4" if args.video else None
        seed = eval_seed(args.seed, held_out=True)  # not the seeds that chose a best checkpoint
        result = evaluate(env, policy, episodes=args.episodes, seed=seed, video_path=video)
    finally:
        env.close()
    out = ckpt["path"] / "eval.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


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

    was = EnvSpec.from_dict(trained)
    changes = [
        f"{what} {old} -> {new}"
        for what, old, new in [
            ("state", list(was.obs.state_names), list(spec.obs.state_names)),
            ("cameras", [c.name for c in was.obs.cameras], [c.name for c in spec.obs.cameras]),
            ("action space", was.action.space, spec.action.space),
            ("actions", list(was.action.names), list(spec.action.names)),
        ]
        if old != new
    ]
    if changes:
        raise UserError(
            f"{' '.join(overrides)}: the policy was trained with other inputs or actions "
            f"({'; '.join(changes)}); eval's overrides change how the task runs, not what the "
            "policy sees or does"
        )


def cmd_demos(args) -> int:
    from embodied.demos import record_demos

    if (cfg := _load(args)) is None:
        return 2
    if Path(cfg.output, "meta", "info.json").exists():
        return _error(
            f"output: {cfg.output} already holds a dataset; choose another output directory"
        )
    if why := file_in_the_way(cfg.output):
        return _error(f"output: {cfg.output} {why}; give a directory for the dataset")
    try:
        summary = record_demos(cfg)
    except (FileNotFoundError, RuntimeError) as e:
        return _error(str(e))
    print(json.dumps(summary, indent=2))
    return 0


def cmd_sft(args) -> int:
    from embodied.sft import sft

    if (cfg := _load(args)) is None:
        return 2
    _pinned(args, cfg.runner.deterministic)
    try:
        sft(cfg)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    return 0


def cmd_bench(args) -> int:
    from embodied.bench import run_bench
    from embodied.config import ConfigError

    if args.checkpoint and args.policy:
        return _error("give either --policy or --checkpoint, not both")
    if args.out and (why := file_in_the_way(args.out)):
        return _error(f"--out {args.out}: {why}; give a directory for the report")
    if (cfg := _load(args)) is None:
        return 2
    try:
        run_bench(
            cfg,
            args.config,
            policy=args.policy or "random",
            checkpoint=args.checkpoint,
            out=args.out,
        )
    except ConfigError as e:
        return _error(str(e))
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from embodied.cli_robot import add_robot_commands
    from embodied.cli_runs import add_run_commands

    p = _Parser(
        prog="embodied", description="Fine-tune robot policies with RL in vectorized simulators."
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _config_command(
        sub,
        "train",
        cmd_train,
        summary="train a policy from a YAML config",
        description="Train from CONFIG; override any key with key.sub=value "
        "(e.g. env.num_envs=16).",
        example="configs/maniskill/pushcube_ppo.yaml",
    )
    _add_eval(sub)
    _config_command(
        sub,
        "demos",
        cmd_demos,
        summary="record demonstrations with an expert into a LeRobot dataset",
        description="Record demonstrations as CONFIG says (expert checkpoint, task, episodes, "
        "output); override any key with key.sub=value.",
        example="configs/maniskill/demos_pushcube.yaml",
    )
    _config_command(
        sub,
        "sft",
        cmd_sft,
        summary="supervised fine-tuning (behaviour cloning) on LeRobot datasets",
        description="Train the policy in CONFIG on its datasets, evaluate per task, save a "
        "checkpoint.",
        example="configs/maniskill/multitask_vla_sft.yaml",
    )
    _add_bench(sub)
    add_robot_commands(sub)
    add_run_commands(sub)
    _add_cluster(sub)
    _add_convert(sub)
    return p


def _config_command(sub, name: str, func, *, summary: str, description: str, example: str) -> None:
    """A command that takes a YAML config and key.sub=value overrides; ``summary``: its line in
    the list of commands."""
    command = sub.add_parser(name, help=summary, description=description)
    command.add_argument("config", help=f"YAML config, e.g. {example}")
    command.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides")
    command.set_defaults(func=func)


def _add_eval(sub) -> None:
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
        "--seed", type=int, default=0, help="evaluation seed, in [0, 100000000) (default 0)"
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


def _add_bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        help="evaluate a policy on a suite of tasks across simulators",
        description="Evaluate a baseline (--policy) or a checkpoint on every task of SUITE; writes "
        "report.md, results.json, success.png and videos, and resumes a killed run.",
    )
    b.add_argument("config", metavar="SUITE", help="suite YAML, e.g. configs/bench/smoke.yaml")
    b.add_argument(
        "overrides", nargs="*", default=[], help="key.sub=value overrides (e.g. episodes=20)"
    )
    b.add_argument(
        "--policy", choices=["random", "zero"], help="a baseline policy (default: random)"
    )
    b.add_argument("--checkpoint", help="a checkpoint directory or RUN/last")
    b.add_argument("--out", help="report directory (default: output_dir/NAME/POLICY)")
    b.set_defaults(func=cmd_bench)


def _add_cluster(sub) -> None:
    c = sub.add_parser(
        "cluster",
        help="what a cluster run's roles run on",
        description="status RUN: each worker's role, node, host, process, GPUs, resources and "
        "last heartbeat, and the faults so far (from RUN/cluster.json).",
    )
    c.add_argument("action", choices=["status"])
    c.add_argument("run", help="a run directory, e.g. runs/multitask_vla_grpo")
    c.set_defaults(func=cmd_cluster)


def _add_convert(sub) -> None:
    v = sub.add_parser(
        "convert",
        help="convert weights: checkpoint, megatron shards, Hugging Face directory",
        description="Convert SOURCE (an embodied checkpoint, a Hugging Face directory of the "
        "Qwen2 family, or a megatron directory this command wrote) into OUT: --to torch (a "
        "checkpoint, whole), --to megatron (one shard file per TP rank), --to hf (a Hugging "
        "Face directory: the language model, or a VLA's policy.vlm_path model).",
    )
    v.add_argument("source", help="a run directory, RUN/last, a checkpoint or a model directory")
    v.add_argument("--to", required=True, choices=["torch", "megatron", "hf"])
    v.add_argument(
        "--tensor-parallel", type=int, default=1, help="TP ranks of --to megatron (default 1)"
    )
    v.add_argument("out", help="the output directory (must not exist)")
    v.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    from embodied.convert import convert

    if why := file_in_the_way(args.out):
        return _error(f"{args.out} {why}; give a new directory")
    out = convert(args.source, args.to, args.out, tensor_parallel=args.tensor_parallel)
    print(f"wrote {out}")
    return 0


def cmd_cluster(args) -> int:
    from embodied.cluster.status import format_status, read_status

    print(format_status(read_status(args.run)))
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as ``main`` reads it; a usage error is one line and SystemExit(2)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (`bench SUITE --policy zero episodes=1`)
    if (
        extra
        and hasattr(args, "overrides")
        and all("=" in a and not a.startswith("-") for a in extra)
    ):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach for a model hub
    args = parse(argv)
    args.restartable = argv is None  # the process's own command line: it may start over
    from embodied.config import ConfigError
    from embodied.schema import UserError

    try:
        return args.func(args)
    except (ConfigError, UserError) as e:
        return _error(str(e))
    except KeyboardInterrupt:
        saves = args.command in ("train", "sft")  # the commands that write checkpoints as they go
        print(
            "interrupted" + ("; the last checkpoint is in the run directory" if saves else ""),
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
