"""Episode statistics of the rollout: per-environment running sums and per-task totals of the
episodes that finished, kept on the device and folded a round at a time (``collect`` calls
``record`` once, after the round)."""

from __future__ import annotations

import torch


class EpisodeStats:
    """Per-environment running sums and per-task totals of finished episodes, on the device.

    Every episode end counts, also a second one inside the same chunk. ``summary()`` moves the
    totals to the host in one transfer."""

    def __init__(self, num_envs: int, task_names: list[str], device: torch.device):
        self.task_names = task_names
        self.returns = torch.zeros(num_envs, device=device)  # f32 [B] running
        self.lengths = torch.zeros(num_envs, device=device)  # f32 [B] running
        self.success = torch.zeros(num_envs, dtype=torch.bool, device=device)  # once, running
        # per task: finished episodes, their returns, lengths and successes, f32 [tasks] each
        self.totals = torch.zeros(4, len(task_names), device=device)

    def restart(self) -> None:
        """Forget the running episodes (after a reset of every environment): episodes cut off by
        the end of a round never count, and nothing of them carries into the next round."""
        self.returns.zero_()
        self.lengths.zero_()
        self.success.zero_()

    def record(
        self,
        task_ids: torch.Tensor,
        reward: torch.Tensor,
        done: torch.Tensor,
        success: torch.Tensor,
    ) -> None:
        """Fold S consecutive environment steps of every environment (a round, once, after it
        ran: a fixed number of operations however long it was). task_ids: long [B]; reward:
        f32 [S, B]; done, success: bool [S, B]."""
        S, B = reward.shape
        device = reward.device
        done_long = done.long()
        # episode slots: (episodes ended before the step) * B + env, f32 sums [3, (S + 1) * B]
        # of reward, steps and successes; slot 0 starts from the running episode's sums
        episode = done_long.cumsum(0) - done_long  # long [S, B]
        envs = torch.arange(B, device=device)
        slot = (episode * B + envs).reshape(-1)  # long [S * B]
        sums = torch.zeros(3, S + 1, B, device=device)
        sums[:, 0] = torch.stack([self.returns, self.lengths, self.success.float()])
        step_values = torch.stack([reward, torch.ones_like(reward), success.float()])
        sums = sums.view(3, -1).index_add_(1, slot, step_values.view(3, -1))
        # each ended episode, at its last step: [count, return, length, success once]
        ended = done.reshape(-1).float()  # f32 [S * B] (done may be a strided view)
        at_end = sums[:, slot] * ended  # f32 [3, S * B]
        at_end[2] = (at_end[2] > 0).float()
        finished = torch.cat([ended[None], at_end])  # f32 [4, S * B]
        self.totals.index_add_(1, task_ids.expand(S, B).reshape(-1), finished)
        # the episodes still running go on from each env's slot after its last end
        running = sums[:, done_long.sum(0) * B + envs]  # f32 [3, B]
        self.returns.copy_(running[0])
        self.lengths.copy_(running[1])
        self.success.copy_(running[2] > 0)

    def summary(self) -> dict[str, float]:
        """episode/{return, length, success_once, count}, and per task when there are several."""
        count, returns, lengths, success = self.totals.tolist()
        out: dict[str, float] = {}
        names = [None] + (self.task_names if len(self.task_names) > 1 else [])
        for name in names:
            rows = range(len(count)) if name is None else [self.task_names.index(name)]
            n = sum(count[i] for i in rows)
            if n == 0:
                continue
            prefix = "episode" if name is None else f"episode/{name}"
            out[f"{prefix}/return"] = sum(returns[i] for i in rows) / n
            out[f"{prefix}/length"] = sum(lengths[i] for i in rows) / n
            out[f"{prefix}/success_once"] = sum(success[i] for i in rows) / n
            out[f"{prefix}/count"] = n
        return out
