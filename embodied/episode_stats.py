"""Episode statistics of the rollout: per-task totals of each environment's first episode of a
round, kept on the device and folded a round at a time (``collect`` calls ``record`` once, after
the round).

Every round starts from a reset of every environment, so the first episodes all began together
under one policy. Later episodes of a round are left out: an environment that succeeds quickly
(where success ends an episode) would add more of them than one that fails, and a failure still
running at the round's end would never count. ``success_once`` is therefore the share of first
episodes that succeeded within the round, whether or not they ended; return and length are
those of the first episodes that ended, and ``unfinished`` counts the rest."""

from __future__ import annotations

import torch


class EpisodeStats:
    """Per-task totals of the rounds' first episodes, on the device. ``summary()`` moves them to
    the host in one transfer."""

    def __init__(self, task_names: list[str], device: torch.device):
        self.task_names = task_names
        # per task: first episodes started, ended, the ended ones' returns and lengths, and the
        # started ones that succeeded within their round; f32 [5, tasks]
        self.totals = torch.zeros(5, len(task_names), device=device)

    def record(
        self,
        task_ids: torch.Tensor,
        reward: torch.Tensor,
        done: torch.Tensor,
        success: torch.Tensor,
    ) -> None:
        """Fold a round of S consecutive environment steps of every environment, from its reset
        (once, after it ran: a fixed number of operations however long it was). task_ids: long
        [B]; reward: f32 [S, B]; done, success: bool [S, B]."""
        done_long = done.long()
        first = (done_long.cumsum(0) - done_long == 0).float()  # f32 [S, B]: to the first end
        ended = done.any(0).float()  # f32 [B]
        per_env = torch.stack(
            [
                torch.ones_like(ended),
                ended,
                (reward * first).sum(0) * ended,
                first.sum(0) * ended,
                (success.float() * first).amax(0),
            ]
        )  # f32 [5, B]
        self.totals.index_add_(1, task_ids, per_env)

    def summary(self) -> dict[str, float]:
        """episode/{success_once, unfinished, count, return, length}, and per task when there
        are several: return and length over the ``count`` first episodes that ended."""
        totals = self.totals.tolist()
        out: dict[str, float] = {}
        names = [None] + (self.task_names if len(self.task_names) > 1 else [])
        for name in names:
            rows = range(len(self.task_names)) if name is None else [self.task_names.index(name)]
            started, ended, returns, lengths, succeeded = (
                sum(row[i] for i in rows) for row in totals
            )
            if started == 0:
                continue
            prefix = "episode" if name is None else f"episode/{name}"
            out[f"{prefix}/success_once"] = succeeded / started
            out[f"{prefix}/unfinished"] = started - ended
            out[f"{prefix}/count"] = ended
            if ended:
                out[f"{prefix}/return"] = returns / ended
                out[f"{prefix}/length"] = lengths / ended
        return out
