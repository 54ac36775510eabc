"""``runner.pipeline_stages: auto``: which stage counts an environment group can split its
chunks into, and the tuner that times each once and keeps the fastest (embodied/rollout.py
pipelines the stages)."""

from __future__ import annotations

STAGE_CANDIDATES = (1, 2, 4, 8)  # stage counts ``runner.pipeline_stages: auto`` tries


def stage_candidates(envs, chunk_size: int) -> list[int]:
    """The stage counts that ``envs`` can really split chunks of ``chunk_size`` into (1 always:
    lockstep)."""
    return [
        s
        for s in STAGE_CANDIDATES
        if s == 1 or (s <= envs.num_envs and len(envs.stage_split(s, chunk_size)) == s)
    ]


class StageTuner:
    """``runner.pipeline_stages: auto``: the first iteration warms up in lockstep (caches,
    allocations; not timed), the next ones try each candidate stage count once, timing the
    collection per environment step, and the fastest is kept from then on. Which count is
    fastest depends on the split between simulation and inference time, measured here rather
    than modelled; runs that must repeat draw for draw give a number instead."""

    def __init__(self, candidates: list[int], chosen: int | None = None):
        self.candidates = candidates
        self.seconds_per_step: dict[int, float] = {}
        self.chosen = chosen if chosen is not None else (1 if len(candidates) == 1 else None)
        self.warmed_up = self.chosen is not None

    def next(self) -> int:
        """The stage count for the coming iteration's collection."""
        if self.chosen is not None:
            return self.chosen
        if not self.warmed_up:
            return 1
        return self.candidates[len(self.seconds_per_step)]

    def record(self, stages: int, seconds: float, env_steps: int) -> bool:
        """An iteration's collection with ``stages`` took ``seconds`` for ``env_steps``;
        whether this settled the choice."""
        if self.chosen is not None:
            return False
        if not self.warmed_up:
            self.warmed_up = True
            return False
        self.seconds_per_step[stages] = seconds / max(env_steps, 1)
        if len(self.seconds_per_step) < len(self.candidates):
            return False
        self.chosen = min(self.seconds_per_step, key=self.seconds_per_step.get)
        return True

    def report(self) -> str:
        timed = ", ".join(
            f"{s}: {1000 * t * 1000:.1f} ms" for s, t in self.seconds_per_step.items()
        )
        return f"pipeline_stages auto: {self.chosen} (collection per 1000 env steps: {timed})"
