"""Loops measured side by side: rounds in which each takes its turn (the order every benchmark
here that compares loops uses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

Result = TypeVar("Result")


def take_turns(
    runs: dict[str, Callable[[], Result]],
    repeats: int,
    *,
    dropped: Callable[[str, Exception], None] | None = None,
    after_round: Callable[[int, dict[str, list[Result]]], None] | None = None,
) -> dict[str, list[Result]]:
    """Each run's result in each of ``repeats`` rounds (label -> one result a round).

    The runs take turns within a round, so that a drift in the machine's speed falls on all of
    them alike, and the first turn passes from run to run, round by round, so that none always
    runs first. A run that raises is raised, unless ``dropped(label, error)`` is given: then it
    is told (it may raise itself) and the run leaves the rounds, its results too.
    ``after_round(index, results)`` is called after each round (progress)."""
    results: dict[str, list[Result]] = {label: [] for label in runs}
    active = dict(runs)
    for index in range(repeats):
        labels = list(active)
        first = index % len(labels) if labels else 0
        for label in labels[first:] + labels[:first]:
            try:
                results[label].append(active[label]())
            except Exception as error:
                if dropped is None:
                    raise
                dropped(label, error)
                del active[label], results[label]
        if after_round is not None:
            after_round(index, results)
    return results
