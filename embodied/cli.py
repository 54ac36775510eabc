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
import signal
import sys
from pathlib import Path

from embodied.cli_errors import error as _error
from embodied.logger import file_in_the_way


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
        from embodied.sft_config import SFTConfig

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
    elif args.command != "sft" and not getattr(getattr(cfg, "runner", None), "replay_from", None):
        check_tasks(cfg.env)  # (SFT's tasks are its datasets', replay_from's its records')
    trainer = getattr(cfg, "trainer", None)
    if files and trainer is not None and trainer.backend == "megatron":
        from embodied.megatron import require

        require()  # (an extra: installed where the run is, not where its config is checked)
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
    from embodied.checkpoint import CheckpointWriteError
    from embodied.config import ConfigError
    from embodied.megatron import RankLost
    from embodied.roles import WorkerLost, WorkerNotStarted
    from embodied.run import NonFiniteUpdate, Stopped
    from embodied.runner import train

    if (cfg := _load(args)) is None:
        return 2
    _pinned(args, cfg.runner.deterministic)
    try:
        train(cfg)
    except ConfigError as e:
        return _error(str(e))
    except Stopped as e:
        return _stopped(e)
    except (CheckpointWriteError, NonFiniteUpdate) as e:  # (what stands is in the message)
        _error(str(e))
        return 1
    except (WorkerLost, WorkerNotStarted, RankLost) as e:  # a role's process lost (or unstarted)
        print(f"embodied: error: {e}{_resume_hint(cfg)}", file=sys.stderr)
        return 1
    return 0


def _resume_hint(cfg) -> str:
    """How to go on after a run that failed: from its last checkpoint, or afresh where it has
    none (it stopped before its first save); nothing where it never began (no run directory)."""
    from embodied.checkpoint import resolve_checkpoint

    run_dir = _run_dir(cfg)
    if not run_dir.is_dir():
        return ""
    try:
        resolve_checkpoint(run_dir)
    except FileNotFoundError:
        return f"; {run_dir} has no checkpoint to resume from: start the run again"
    return f"; resume with runner.resume={run_dir}"


def _run_dir(cfg) -> Path:
    """The directory a train command runs in: its resumed checkpoint's run, or
    output_dir/name (a resume from RUN/checkpoints/iter_N writes to RUN)."""
    if not cfg.runner.resume:
        return Path(cfg.runner.output_dir) / cfg.runner.name
    from embodied.checkpoint import resolve_checkpoint
    from embodied.run import run_dir_of

    return run_dir_of(resolve_checkpoint(cfg.runner.resume), cfg.runner.resume)


def cmd_demos(args) -> int:
    from embodied.dataset import taken
    from embodied.demos import record_demos

    if (cfg := _load(args)) is None:
        return 2
    if why := taken(Path(cfg.output)):
        return _error(f"output: {cfg.output} {why}")
    if why := file_in_the_way(cfg.output):
        return _error(f"output: {cfg.output} {why}; give a directory for the dataset")
    summary = record_demos(cfg)  # (its user errors are UserErrors; the rest keep a traceback)
    print(json.dumps(summary, indent=2))
    if summary["stopped"]:  # (the dataset holds the episodes kept before the signal)
        print(
            f"embodied: stopped ({summary['stopped']}) after {summary['episodes']} of "
            f"{cfg.episodes} episodes; the dataset holds them",
            file=sys.stderr,
        )
        return 128 + signal.Signals[summary["stopped"]].value
    return 0


def _stopped(stop) -> int:
    """A run stopped by a signal, its step saved: the line saying where, 128 + the signal."""
    print(f"embodied: {stop}", file=sys.stderr)
    return 128 + stop.signum


def cmd_sft(args) -> int:
    from embodied.checkpoint import CheckpointWriteError
    from embodied.megatron import RankLost
    from embodied.run import NonFiniteUpdate, Stopped
    from embodied.sft import sft

    if (cfg := _load(args)) is None:
        return 2
    _pinned(args, cfg.runner.deterministic)
    try:
        sft(cfg)
    except Stopped as e:
        return _stopped(e)
    except (CheckpointWriteError, NonFiniteUpdate) as e:  # (what stands is in the message)
        _error(str(e))
        return 1
    except RankLost as e:  # (its last checkpoint stands)
        print(f"embodied: error: {e}{_resume_hint(cfg)}", file=sys.stderr)
        return 1
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
    if args.checkpoint and _trained_deterministic(args.checkpoint):
        from embodied import numerics

        _pinned(args, True)  # the checkpoint's floats again, on any CPU, as `embodied eval`
        numerics.pin()
    try:
        run_bench(
            cfg,
            args.config,
            policy=args.policy or "random",
            checkpoint=args.checkpoint,
            out=args.out,
        )
    except (ConfigError, FileNotFoundError) as e:  # (a checkpoint not found: its one line)
        return _error(str(e))
    return 0


def _trained_deterministic(checkpoint: str) -> bool:
    """Whether the checkpoint was trained with runner.deterministic (False where its meta.json
    cannot say: the bench's own loading names a bad checkpoint)."""
    from embodied.checkpoint import META, resolve_checkpoint

    try:
        meta = json.loads((resolve_checkpoint(checkpoint) / META).read_text())
        return meta["config"]["runner"]["deterministic"] is True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build_parser() -> argparse.ArgumentParser:
    from embodied.cli_eval import add_eval
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
    add_eval(sub)
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
    except (ConfigError, UserError) as e:  # (with its notes: demos' "the N episodes kept are in")
        return _error("; ".join([str(e), *getattr(e, "__notes__", [])]))
    except KeyboardInterrupt:  # (a stop in the training loop saves and returns: not here)
        saves = args.command in ("train", "sft")  # the commands that write checkpoints as they go
        said = "; nothing was saved since the run's last checkpoint, if it has one"
        print("interrupted" + (said if saves else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
