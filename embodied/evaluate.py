"""Evaluation: N seeded episodes with deterministic actions; success rate with its episode count."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embodied.logger import write_atomic
from embodied.rollout import share_bounds
from embodied.run import Interrupted
from embodied.video import tile, write_mp4

VIDEO_TILES = 4  # environments shown side by side in the evaluation video


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate; it holds the rate itself (at 0 and 1 the
    formula's bound missed it by a rounding: 100/100 gave an upper bound of 1 - 1e-16)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


@torch.no_grad()
def evaluate(
    env,
    policy,
    *,
    episodes: int,
    seed: int,
    deterministic: bool = True,
    video_path: Path | None = None,
    progress=None,
    should_stop: Callable[[], bool] | None = None,
) -> dict:
    """Run ``episodes`` episodes (episode i reset with seed ``seed + i``: ``seed`` from
    ``embodied.seeds.eval_seed``, selection or held out), the first episode of each environment
    per round counted. Returns success rate, returns, lengths.
    ``should_stop`` is asked before every policy call; when it says so, ``Interrupted`` is
    raised."""
    ranges = [(0, env.num_envs)]
    args = (deterministic, video_path, progress, should_stop)
    return _run(env, policy, ranges, [(episodes, seed)], *args)[0]


@torch.no_grad()
def evaluate_by_task(
    env,
    policy,
    *,
    episodes: int,
    seed: int,
    deterministic: bool = True,
    video_path: Path | None = None,
    progress=None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, dict]:
    """``evaluate()`` per task of a MultiTaskEnv, all tasks stepping at once (their workers run in
    parallel): {task: summary}, each over ``episodes`` episodes with the seeds ``evaluate()`` would
    give that task's environment alone. A single-task env is reported as one task, "all". The
    video shows the first environment of each task (up to four tasks)."""
    shares = [(episodes, seed)] * len(getattr(env, "task_ranges", [None]))
    return evaluate_shares(
        env,
        policy,
        shares=shares,
        deterministic=deterministic,
        video_path=video_path,
        progress=progress,
        should_stop=should_stop,
    )


@torch.no_grad()
def evaluate_shares(
    env,
    policy,
    *,
    shares: list[tuple[int, int]],
    deterministic: bool = True,
    video_path: Path | None = None,
    progress=None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, dict]:
    """``evaluate_by_task`` with each task's own (episodes, seed) from ``shares`` (in the
    env's task order): one part of an evaluation split with ``split_episodes``. Tasks with no
    episodes are left out of the result."""
    ranges = getattr(env, "task_ranges", [(0, env.num_envs)])
    names = getattr(env, "names", ["all"])
    args = (deterministic, video_path, progress, should_stop)
    summaries = _run(env, policy, ranges, shares, *args)
    return {name: s for name, s in zip(names, summaries) if s is not None}


@dataclass
class _Round:
    """One round of a reset of every row: a row counts while its first episode runs."""

    seeds: list[int]
    active: torch.Tensor  # bool [B]: the row's episode is counted and still running
    ret: torch.Tensor  # f32 [B], on the CPU
    length: torch.Tensor  # i64 [B]
    success: torch.Tensor  # bool [B]: succeeded at some step


@dataclass
class _Timing:
    """Policy latency and simulator throughput over an evaluation."""

    policy_s: float = 0.0
    env_s: float = 0.0
    policy_calls: int = 0
    env_steps: int = 0

    def summary(self) -> dict:
        return {
            "eval/policy_ms": 1000 * self.policy_s / max(1, self.policy_calls),
            "eval/env_steps_per_s": self.env_steps / max(self.env_s, 1e-9),
        }


class _Video:
    """The first round's frames of the shown rows: the first VIDEO_TILES environments, or the
    first of each task; an ended episode's tile keeps its last frame instead of the reset."""

    def __init__(self, env, ranges: list[tuple[int, int]], path: Path | None):
        B = env.num_envs
        rows = (
            torch.arange(min(B, VIDEO_TILES))
            if len(ranges) == 1
            else torch.tensor([lo for lo, _ in ranges[:VIDEO_TILES]])
        )
        self.env = env
        self.path = path
        self.rows = rows  # i64 [<=4], on the CPU
        self.frames: list[np.ndarray] = []
        self.recording = False

    def start_round(self) -> None:
        self.recording = self.path is not None and not self.frames  # the first round only
        if self.recording:
            self.shown = self.env.render(self.rows)  # uint8 [<=4, H, W, 3]
            self.frames.append(tile(self.shown))

    def after_step(self, active: torch.Tensor, done: torch.Tensor) -> None:
        if not self.recording or not bool(active[self.rows].any()):
            return
        live = (active & ~done)[self.rows].to(self.shown.device).view(-1, 1, 1, 1)
        rendered = self.env.render(self.rows)  # only the shown rows render
        self.shown = torch.where(live, rendered, self.shown)
        self.frames.append(tile(self.shown))

    def write(self, summaries: list[dict | None]) -> None:
        if self.path is None or not self.frames:
            return
        try:
            write_mp4(self.path, self.frames, fps=self.env.spec.action.control_hz)
        except OSError as e:  # (a full or read-only disk: the evaluation's numbers stand)
            _not_written(self.path, e)
            return
        for summary in filter(None, summaries[:VIDEO_TILES]):  # (the tasks it shows)
            summary["eval/video"] = str(self.path)


def _not_written(path: Path, error: OSError) -> None:
    print(f"note: video {path} not written ({error.strerror or error})", file=sys.stderr)


def write_recorded_video(path: Path, data: bytes) -> bool:
    """An evaluation's mp4 recorded elsewhere (an env worker's bytes) as ``path``, whole or not
    at all; False, said, where the disk refuses it (the evaluation's numbers stand)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    except OSError as e:
        _not_written(path, e)
        return False
    return True


def _run(
    env,
    policy,
    ranges: list[tuple[int, int]],
    shares: list[tuple[int, int]],
    deterministic: bool,
    video_path: Path | None,
    progress,
    should_stop: Callable[[], bool] | None,
) -> list[dict | None]:
    """Evaluate each row range [lo, hi) of ``env`` as a population of its share's episodes
    (episode i reset with the share's seed plus i); None for a range without episodes."""
    device = _device_of(policy, env.device)  # the policy may live elsewhere (runner.device)
    results: list[list[dict]] = [[] for _ in ranges]
    group = torch.zeros(env.num_envs, dtype=torch.long)  # row -> index of its range
    for g, (lo, hi) in enumerate(ranges):
        group[lo:hi] = g
    timing = _Timing()
    video = _Video(env, ranges, video_path)
    while any(len(r) < episodes for r, (episodes, _) in zip(results, shares)):
        round_state = _new_round(env.num_envs, ranges, results, shares)
        obs = env.reset(seed=round_state.seeds)
        video.start_round()
        while bool(round_state.active.any()):
            if should_stop is not None and should_stop():
                raise Interrupted
            t0 = time.perf_counter()
            out = policy.act(obs.to(device), deterministic=deterministic)
            actions = out.actions.to(env.device)
            _finish(actions.device)  # (else its kernels count as the simulator's step)
            timing.policy_s += time.perf_counter() - t0
            timing.policy_calls += 1
            for k in range(actions.shape[1]):
                obs, ended = _step(env, actions[:, k], round_state, timing, video)
                for row, episode in ended:
                    results[int(group[row])].append(episode)
                    if progress is not None:
                        progress.update(1)
                if not bool(round_state.active.any()):
                    break
    summaries = [
        _summary(sorted(res, key=lambda e: e["seed"])[:episodes]) if episodes > 0 else None
        for res, (episodes, _) in zip(results, shares)
    ]
    for summary in filter(None, summaries):  # shared by the tasks of a MultiTaskEnv
        summary.update(timing.summary())
    video.write(summaries)
    return summaries


def _finish(device: torch.device) -> None:
    """Wait for the work queued on a CUDA ``device``: a policy's kernels run after ``act``
    returns, and the step's transfer would wait for them instead (evaluation's timing only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _new_round(
    B: int,
    ranges: list[tuple[int, int]],
    results: list[list[dict]],
    shares: list[tuple[int, int]],
) -> _Round:
    """The next round's seeds, and the rows whose episodes its ranges still need."""
    seeds = [0] * B
    active = torch.zeros(B, dtype=torch.bool)  # bool [B]
    for (lo, hi), res, (episodes, seed) in zip(ranges, results, shares):
        n = max(0, min(hi - lo, episodes - len(res)))
        base = seed + len(res)
        seeds[lo:hi] = [base + i for i in range(hi - lo)]
        active[lo : lo + n] = True
    ret = torch.zeros(B)  # f32 [B]
    length = torch.zeros(B, dtype=torch.long)  # i64 [B]
    success = torch.zeros(B, dtype=torch.bool)  # bool [B]
    return _Round(seeds, active, ret, length, success)


def _step(env, action: torch.Tensor, round_state: _Round, timing: _Timing, video: _Video):
    """One env step of the round: its observation, and (row, episode) for each row whose counted
    episode ended in it."""
    t0 = time.perf_counter()
    step = env.step(action)
    done = step.terminated | step.truncated
    # one transfer per step (it waits for a GPU simulator, as the timing should)
    host = torch.stack([step.reward, step.success.float(), done.float()]).cpu()
    reward = host[0]
    success = host[1] > 0
    done = host[2] > 0
    timing.env_s += time.perf_counter() - t0
    timing.env_steps += env.num_envs
    round_state.ret += reward * round_state.active
    round_state.length += round_state.active.long()
    round_state.success |= success & round_state.active
    video.after_step(round_state.active, done)
    ended = [
        (row, _episode(round_state, row, bool(success[row])))
        for row in (done & round_state.active).nonzero().squeeze(1).tolist()
    ]
    round_state.active &= ~done
    return step.obs, ended


def _episode(round_state: _Round, row: int, success_at_end: bool) -> dict:
    """The record of ``row``'s episode, which ended in this step."""
    return {
        "seed": round_state.seeds[row],
        "success": bool(round_state.success[row]),
        "success_at_end": success_at_end,
        "return": float(round_state.ret[row]),
        "length": int(round_state.length[row]),
    }


def _device_of(policy, default) -> torch.device:
    """Where ``policy`` takes its observations: a module's parameters', an inference copy's
    ``device`` (one acting in another process: the device it is sent from), else ``default``."""
    parameter = next(iter(policy.parameters()), None) if hasattr(policy, "parameters") else None
    if parameter is not None:
        return parameter.device
    return torch.device(getattr(policy, "device", default))


def _summary(results: list[dict]) -> dict:
    wins = sum(e["success"] for e in results)
    lo, hi = wilson_interval(wins, len(results))
    # success_rate: the task was achieved at some step of the episode (ManiSkill's success_once)
    return {
        "eval/success_rate": wins / len(results),
        "eval/episodes": len(results),
        "eval/success_ci95": [lo, hi],
        "eval/success_at_end": sum(e["success_at_end"] for e in results) / len(results),
        "eval/return": float(np.mean([e["return"] for e in results])),
        "eval/length": float(np.mean([e["length"] for e in results])),
    }


def overall(results: dict[str, dict]) -> dict:
    """The summaries of several tasks of one evaluation as one (episodes pooled: at equal
    episodes, the mean over tasks); one task's summary as it is."""
    if not results:
        raise ValueError("overall: no task's summary to pool (an evaluation of no episodes)")
    return pooled_summary(list(results.values()))


def split_episodes(episodes: int, seed: int, parts: int) -> list[tuple[int, int]]:
    """(episodes, seed) of each of up to ``parts`` evaluations that together run the episodes
    of one evaluation of ``episodes`` at ``seed``: episode i's reset seed is the seed plus i,
    so the part that starts at episode j takes the seed plus j."""
    parts = min(parts, episodes)
    bounds = [share_bounds(episodes, part, parts) for part in range(parts)]
    return [(end - first, seed + first) for first, end in bounds]


def pooled_summary(summaries: list[dict], *, side_by_side: bool = False) -> dict:
    """Several summaries as one, their episodes pooled; one summary as it is. Timings: the
    tasks of one evaluation (``side_by_side`` False) share it, so the first's are taken; the
    parts of one evaluation that ``split_episodes`` made ran ``side_by_side`` in processes of
    their own, so the rate is the sum of the parts' ``eval/env_steps_per_s`` (each its own
    steps over its own seconds: their throughput together) and the policy's latency their
    mean."""
    if not summaries:
        raise ValueError("pooled_summary: no summaries to pool (an evaluation of no episodes)")
    if len(summaries) == 1:
        return dict(summaries[0])
    n = sum(r["eval/episodes"] for r in summaries)
    wins = round(sum(r["eval/success_rate"] * r["eval/episodes"] for r in summaries))
    lo, hi = wilson_interval(wins, n)

    def pooled(key: str) -> float:
        return sum(r[key] * r["eval/episodes"] for r in summaries) / n

    out = {
        "eval/success_rate": wins / n,
        "eval/episodes": n,
        "eval/success_ci95": [lo, hi],
        "eval/success_at_end": pooled("eval/success_at_end"),
        "eval/return": pooled("eval/return"),
        "eval/length": pooled("eval/length"),
    }
    for key in ("eval/policy_ms", "eval/env_steps_per_s", "eval/video"):
        if key in summaries[0]:
            out[key] = summaries[0][key]
    if side_by_side and "eval/env_steps_per_s" in out:
        out["eval/env_steps_per_s"] = sum(r["eval/env_steps_per_s"] for r in summaries)
        out["eval/policy_ms"] = sum(r["eval/policy_ms"] for r in summaries) / len(summaries)
    return out


def per_task(task: str, summary: dict) -> dict:
    """An ``evaluate()`` summary with its keys moved under the task: eval/x -> eval/<task>/x."""
    return {f"eval/{task}/{k.split('/', 1)[1]}": v for k, v in summary.items()}
