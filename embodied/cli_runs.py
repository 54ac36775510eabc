"""``embodied replay``, ``episodes`` and ``report``: the commands that read what a run left in its
directory (its records, its logs), and their options."""

from __future__ import annotations

import sys
from pathlib import Path

from embodied.cli_errors import error as _error
from embodied.logger import file_in_the_way


def add_run_commands(sub) -> None:
    """The replay, episodes and report subcommands of ``embodied``'s parser."""
    _add_replay(sub)
    _add_episodes(sub)
    _add_report(sub)


def _add_replay(sub) -> None:
    r = sub.add_parser(
        "replay",
        help="run a recorded iteration's update again and compare it with the run",
        description="Load the learner's state before iteration N and its rounds from "
        "RUN/rollouts (runner.record_rollouts), run the update, and compare its metrics and "
        "the weights after it with the run's: exit 0 when they match, 1 with one line when not. "
        "The record keeps a digest of the weights after the update, so they compare bit for bit "
        "only: with --rtol the metrics decide, and the weights are said to be equal or not.",
    )
    r.add_argument("run", help="a run directory with RUN/rollouts")
    r.add_argument("--iteration", type=int, required=True, help="the recorded iteration")
    r.add_argument("--device", default="cpu", help="where the update runs (default cpu)")
    r.add_argument(
        "--rtol",
        type=float,
        default=0.0,
        help="relative tolerance for the metrics (default 0: all bit for bit); the weights are "
        "then reported, not compared within it",
    )
    r.set_defaults(func=cmd_replay)


def _add_episodes(sub) -> None:
    ep = sub.add_parser(
        "episodes",
        help="write a recorded iteration's episodes as mp4 and plots",
        description="Find the episodes of RUN/rollouts/iter_N (runner.record_rollouts; every "
        "record without --iteration) and write the chosen ones as an mp4 of the policy's camera "
        "and a PNG of actions, rewards and success per step, under --out (default "
        "RUN/episodes), or as LeRobot v3 datasets (--to-dataset; one per task).",
    )
    ep.add_argument("run", help="a run directory with RUN/rollouts")
    ep.add_argument(
        "--iteration", type=int, help="the recorded iteration (default: every recorded one)"
    )
    ep.add_argument(
        "--best", type=int, default=0, help="the N episodes of highest return (of all records read)"
    )
    ep.add_argument(
        "--worst", type=int, default=0, help="the N episodes of lowest return (of all records read)"
    )
    ep.add_argument("--task", help="episodes of this task only")
    ep.add_argument("--seed", type=int, help="the episode that began at this reset seed")
    outcome = ep.add_mutually_exclusive_group()
    outcome.add_argument("--successful", action="store_true", help="successful episodes only")
    outcome.add_argument("--failed", action="store_true", help="failed episodes only")
    ep.add_argument(
        "--partial",
        action="store_true",
        help="also episodes whose first steps went unrecorded (begun mid-chunk after another)",
    )
    ep.add_argument("--out", help="where the files go (default RUN/episodes)")
    ep.add_argument(
        "--resimulate",
        action="store_true",
        help="simulate the rounds again from their seeds and actions: a frame per step, "
        "where the rewards or observations diverge from the record, and each world's randomised "
        "parameters for "
        "--to-dataset (which does so by itself for chunked policies)",
    )
    ep.add_argument(
        "--atol",
        type=float,
        default=0.0,
        help="re-simulated rewards and observations within this of the recorded ones agree "
        "(default 0: equal)",
    )
    ep.add_argument(
        "--to-dataset",
        metavar="DIR",
        help="write the chosen episodes as a LeRobot v3 dataset there instead (for embodied sft)",
    )
    ep.set_defaults(func=cmd_episodes)


def _add_report(sub) -> None:
    o = sub.add_parser(
        "report",
        help="write RUN/report.html: the run's success, per-task tables, time, episodes, events",
        description="Write one self-contained RUN/report.html (no server, no network) from what "
        "the run directory holds: its config, the success curve with 95% intervals (success "
        "once and at the end), per-task tables, throughput and time per phase, the best and "
        "worst episodes of its newest record, and its events. A run writes it at its end too.",
    )
    o.add_argument("run", help="a run directory, e.g. runs/pushcube_ppo")
    o.set_defaults(func=cmd_report)


def _shared(config: dict) -> str:
    """Why a record's update cannot replay bit for bit in one process, where it was shared."""
    cluster = config.get("cluster", {})
    workers = cluster.get("actor", {}).get("workers", 1)
    if not cluster.get("enabled") or workers <= 1:
        return ""
    return (
        f" (recorded by {workers} data-parallel actor workers, each summing its share: not bit "
        "for bit here; use --rtol)"
    )


def cmd_replay(args) -> int:
    from embodied.megatron import RankLost, require
    from embodied.numerics import restart_pinned
    from embodied.recording import record_meta
    from embodied.replay import differences, replay
    from embodied.schema import UserError, checked_device

    if not args.rtol >= 0:
        return _error(f"--rtol: must be >= 0, got {args.rtol:g}")
    try:
        checked_device("--device", args.device, "--device cpu")
        # a deterministic run's update replays in a process pinned as it was
        config = record_meta(Path(args.run), args.iteration)["config"]
        if config.get("trainer", {}).get("backend") == "megatron":
            require()  # (an extra: a one-line error where it is not installed)
        runner = config["runner"]
        restart_pinned(runner.get("deterministic"), getattr(args, "restartable", False))
        record, metrics, digest = replay(Path(args.run), args.iteration, args.device)
    except UserError as e:  # (a record that is missing or damaged, the device, an extra)
        return _error(str(e))
    except RankLost as e:  # (a TP rank's process lost: one line)
        _error(str(e))
        return 1
    weights = None if args.rtol else (record.meta["digest_after"], digest)
    found = differences(record.meta["metrics"], metrics, args.rtol, weights)
    if found:
        print(
            f"embodied: replay of iteration {args.iteration} differs{_shared(config)}: "
            f"{'; '.join(found)}",
            file=sys.stderr,
        )
        return 1
    done = f"iteration {args.iteration} replayed"
    if not args.rtol:
        print(f"{done} bit for bit: {len(metrics)} metrics and the weights")
        return 0
    logged = record.meta["digest_after"]
    weights = "equal" if logged == digest else f"differ (digest {logged[:12]} vs {digest[:12]})"
    print(
        f"{done} within rtol {args.rtol:g}: {len(metrics)} metrics; the weights after the update, "
        f"which compare bit for bit only (the record keeps their digest), {weights}"
    )
    return 0


def _episodes_options(args) -> str | None:
    """What is wrong with ``embodied episodes``' options alone, or None."""
    for option in ("best", "worst"):
        if getattr(args, option) < 0:
            return f"--{option}: must be >= 0 (episodes), got {getattr(args, option)}"
    if not args.atol >= 0:
        return f"--atol: must be >= 0, got {args.atol:g}"
    for option, value, what in (
        ("--out", args.out, "the episodes' files"),
        ("--to-dataset", args.to_dataset, "the datasets"),
    ):
        if value and (why := file_in_the_way(value)):
            return f"{option} {value}: {why}; give a directory for {what}"
    return None


def cmd_episodes(args) -> int:
    from embodied.episode_dataset import EpisodeDatasets
    from embodied.episodes import summary_line, write_episode
    from embodied.record_files import recorded_iterations
    from embodied.recording import read_rounds, record_meta
    from embodied.resimulate import Resimulator
    from embodied.schema import UserError

    if wrong := _episodes_options(args):
        return _error(wrong)
    run = Path(args.run)
    iterations = [args.iteration] if args.iteration is not None else recorded_iterations(run)
    if not iterations:
        return _error(f"{run / 'rollouts'}: no records (runner.record_rollouts)")
    if wrong := _unknown_task(record_meta(run, iterations[0]), args.task):
        return _error(wrong)
    out = Path(args.out) if args.out else run / "episodes"
    datasets = None
    resimulator = Resimulator()
    try:
        chosen, last = _chosen(run, iterations, args)
        if args.to_dataset:
            source = {"run": str(run), "episodes": "rl", "iterations": iterations}
            source["simulator"] = last.meta["config"]["env"].get("simulator")
            datasets = EpisodeDatasets(Path(args.to_dataset), last, source)
        for iteration in [i for i in iterations if chosen[i]]:
            record = last if iteration == last.meta["iteration"] else read_rounds(run, iteration)
            episodes = chosen[iteration]
            chunked = record.rounds[0].actions.shape[2] > 1
            resimulated = {}
            if args.resimulate or (args.to_dataset and chunked):
                resimulated, episodes = _resimulated(resimulator, record, episodes, args.atol)
            for episode in episodes:
                again = resimulated.get(episode.round_index)
                if datasets is not None:
                    datasets.add(record, episode, again)
                    continue
                video, plot = write_episode(record, episode, out, again)
                print(f"{summary_line(episode)}: {video or 'no camera'}, {plot}")
    except (UserError, OSError) as e:  # (a record, a dataset directory, a re-simulation; a
        # folder this user cannot write, a full disk)
        if datasets is not None:
            print(f"the datasets under {args.to_dataset} are incomplete (no metadata written)")
        return _error(_os_error(e) if isinstance(e, OSError) else str(e))
    finally:
        resimulator.close()
    if datasets is not None:
        written = datasets.close()
        where = ", ".join(map(str, written)) or "nowhere (no episode chosen)"
        print(f"wrote {datasets.count} episodes to {where}")
    return 0


def _unknown_task(meta: dict, task: str | None) -> str | None:
    """What is wrong with ``--task`` for a run whose record has ``meta``, or None."""
    from embodied.episodes import record_tasks

    names = record_tasks(meta)
    if task is None or task in names:
        return None
    return f"--task {task}: not a task of this run; its tasks: {', '.join(names)}"


def _chosen(run: Path, iterations: list[int], args) -> tuple[dict[int, list], object]:
    """The episodes ``embodied episodes``' options ask for, by iteration: those of each record
    that pass its filters (task, outcome, seed, whole), then the ``--best`` and ``--worst`` of
    them all, not of each record; how many each record gave said. Also the last record read
    (the only one for one iteration: it is not read again)."""
    from embodied.episodes import choose, episodes_of, with_seeds
    from embodied.recording import read_rounds

    outcome = "successful" if args.successful else "failed" if args.failed else None
    kw = dict(task=args.task, outcome=outcome, partial=args.partial, seed=args.seed)
    found = {}
    kept = []
    for iteration in iterations:
        record = read_rounds(run, iteration)
        episodes = episodes_of(record)
        if args.seed is not None or args.to_dataset:  # (a dataset keeps each episode's seed)
            with_seeds(record, episodes)
        found[iteration] = len(episodes)
        kept += choose(episodes, **kw)
    chosen = choose(kept, best=args.best, worst=args.worst, partial=True)  # (filtered above)
    by_iteration = {i: [e for e in chosen if e.iteration == i] for i in iterations}
    for i in iterations:
        print(
            f"iteration {i}: {found[i]} episodes end in the record, {len(by_iteration[i])} chosen"
        )
    return by_iteration, record


def _resimulated(resimulator, record, chosen: list, atol: float) -> tuple[dict, list]:
    """Each round the chosen episodes are in, simulated again ({round: Resimulated}), and the
    episodes whose rewards agree with the record's to their end; the others are named."""
    from embodied.episodes import summary_line

    iteration = record.meta["iteration"]
    rounds = resimulator.rounds(record, {e.round_index for e in chosen}, atol)
    for resimulated in rounds.values():
        print(f"iteration {iteration} {resimulated.summary()}")
    kept = [e for e in chosen if rounds[e.round_index].agrees(e.row, e.steps(record)[-1])]
    for episode in chosen:
        if episode not in kept:
            print(f"left out, re-simulated apart before its end: {summary_line(episode)}")
    return rounds, kept


def cmd_report(args) -> int:
    from embodied.report import write_report
    from embodied.schema import UserError

    try:
        path = write_report(Path(args.run))
    except UserError as e:
        return _error(str(e))
    except OSError as e:  # (a colleague's run directory, a read-only mount, a full disk)
        return _error(_os_error(e))
    print(f"wrote {path}")
    return 0


def _os_error(error: OSError) -> str:
    """An OSError of reading or writing a file as one line: the file, then why."""
    return f"{error.filename}: {error.strerror}" if error.filename else str(error)
