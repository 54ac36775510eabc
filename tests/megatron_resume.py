"""SFT on megatron saved after its first step and resumed by a new learner (each TP rank, in the
processes of test_megatron.py): what the load gave and the second step; with torch's Adam
(megatron's fallback here) and with an Adam that counts its steps per parameter group, as
Transformer Engine's and Apex's FusedAdam do. And a TP=2 save whose helper rank cannot write
its shard (test_megatron_runs.py)."""

import contextlib

import torch
import torch.distributed as dist
from megatron_cases import bc_parts, bc_setup, bc_step
from torch.optim.adam import adam

from embodied.sft import BCLearner


class GroupStepAdam(torch.optim.AdamW):
    """Adam as Transformer Engine's and Apex's FusedAdam keep its state: the moments per
    weight, one step count per parameter group (``group["step"]``, none per weight); the
    update is torch's AdamW's (its functional form), so the numbers are torch's."""

    def __init__(self, params, adam_w_mode: bool = True, **options):
        assert adam_w_mode  # (megatron asks for decoupled weight decay)
        super().__init__(params, **options)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
            done = group.get("step", 0)
            group["step"] = done + 1
            beta1, beta2 = group["betas"]
            adam(
                params,
                [p.grad for p in params],
                [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params],
                [],
                [torch.tensor(float(done)) for _ in params],  # (the function adds this step)
                foreach=False,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )


@contextlib.contextmanager
def fused_adam():
    """megatron-core builds its Adam as it does with Transformer Engine or Apex installed
    (their FusedAdam's keyword, its class), the class ``GroupStepAdam``."""
    import megatron.core.optimizer as optimizers

    saved = optimizers.USING_PYTORCH_OPTIMIZER, optimizers.Adam
    optimizers.USING_PYTORCH_OPTIMIZER, optimizers.Adam = False, GroupStepAdam
    try:
        yield
    finally:
        optimizers.USING_PYTORCH_OPTIMIZER, optimizers.Adam = saved


def save_bc(learner, run_dir, step: int) -> None:
    """The learner's checkpoint of ``step`` (every rank: rank 0 saves, the others write their
    shards where it stages it, as the runner's TP ranks do)."""
    from embodied.checkpoint import staging_dir

    learner.refresh()
    if dist.get_rank() == 0:
        learner.save(run_dir, step, counters={"iteration": step}, meta={})
    else:
        learner.engine.write_shards(staging_dir(run_dir, step))
    dist.barrier()


def bc_resumed(run_dir) -> dict:
    """SFT's first two steps, their checkpoint, a new learner loaded from it, the third step:
    the checkpoint, what the new learner holds after the load (weights on megatron, its main
    weights, the torch copy, Adam's state) and the third step's numbers and weights. (After
    one step the load's dummy step counts 1 too: a count not restored passed.)"""
    from embodied.checkpoint import checkpoint_dir, load_checkpoint

    first, data = bc_setup("megatron")
    out = {}
    for step in range(2):
        bc_step(first, data, step, out)
    save_bc(first, run_dir, 2)
    checkpoint = load_checkpoint(checkpoint_dir(run_dir, 2))
    learner, _ = bc_setup("megatron")
    learner.load(checkpoint)
    engine = learner.engine
    trained = [(name, p) for name, p in engine.policy.named_parameters() if p.requires_grad]
    mains = {n: engine._main_param(p).detach().clone().view(p.shape) for n, p in trained}
    loaded = {
        "engine": engine.torch_state(),
        "main": engine._torch_layout(mains),
        "copy": engine.torch_policy.state_dict(),
    }
    # (copies: the live weights change in the next step)
    out.update({f"loaded_{k}": {n: t.clone() for n, t in v.items()} for k, v in loaded.items()})
    out["loaded_adam"] = engine.whole_optimizer_state()
    out["checkpoint"] = {"model": checkpoint["model"], "optimizer": checkpoint["optimizer"]}
    bc_step(learner, data, 2, out)
    learner.refresh()
    out["state"] = engine.torch_policy.state_dict()
    out["adam"] = engine.whole_optimizer_state()
    return out


def resume_rank(rank: int, tp: int, out: str) -> None:
    """One TP rank: ``bc_resumed`` with torch's Adam, and with ``GroupStepAdam``."""
    torch.save(bc_resumed(f"{out}/bc_resume"), f"{out}/bc_resume{rank}.pt")
    with fused_adam():
        result = bc_resumed(f"{out}/bc_resume_fused")
    torch.save(result, f"{out}/bc_resume_fused{rank}.pt")


def no_space(directory) -> None:
    raise OSError(28, "No space left on device")


class ShardWriteFails(BCLearner):
    """SFT's learner whose TP rank 1 cannot write its shard (a full disk there)."""

    def __init__(self, *args):
        super().__init__(*args)
        if self.engine.tp_rank == 1:
            self.engine.write_shards = no_space


def shard_write_fails(rank: int, out) -> None:
    """In a process of its own: SFT's learner at TP=2 (its helper rank a process), whose helper
    fails to write its shard; the error the save ended with, and how many processes are left."""
    import multiprocessing

    from embodied.checkpoint import CheckpointWriteError
    from embodied.megatron.lockstep import Lockstep, start_ranks

    torch.set_num_threads(1)
    cfg, spec, norm_data, _ = bc_parts("megatron", tensor_parallel=2)
    cpu = torch.device("cpu")
    helpers = start_ranks(cfg, cpu, ShardWriteFails, spec, norm_data)
    learner = Lockstep(ShardWriteFails(cfg, spec, norm_data, cpu), helpers)
    try:
        learner.save(out / "run", 1, counters={"iteration": 1}, meta={})
    except CheckpointWriteError as error:
        (out / "error.txt").write_text(str(error))
    finally:
        learner.close()
    (out / "left.txt").write_text(str(len(multiprocessing.active_children())))


def helper_killed(rank: int, out, how: str = "killed") -> None:
    """In a process of its own: SFT's learner at TP=2, its helper rank SIGKILLed between two
    steps (``how``: "killed"), or the second step given actions of another size, which every
    rank fails on ("bad_batch"); the error the second step ended with, and how many processes
    are left."""
    import multiprocessing
    import os
    import signal

    from embodied.megatron import RankLost
    from embodied.megatron.lockstep import Lockstep, start_ranks

    torch.set_num_threads(1)
    cfg, spec, norm_data, data = bc_parts("megatron", tensor_parallel=2)
    cpu = torch.device("cpu")
    helpers = start_ranks(cfg, cpu, BCLearner, spec, norm_data)
    learner = Lockstep(BCLearner(cfg, spec, norm_data, cpu), helpers)
    (helper, _) = helpers[0]
    try:
        learner.bc_step(*data, None, 1e-3)
        if how == "killed":
            os.kill(helper.pid, signal.SIGKILL)
            helper.join()
        else:
            obs, actions, mask = data
            data = (obs, torch.cat([actions, actions], dim=-1), mask)  # (4 action dims of 2)
        learner.bc_step(*data, None, 1e-3)
    except RankLost as error:
        (out / "error.txt").write_text(f"{error} / {helper.pid}")
    finally:
        learner.close()
    (out / "left.txt").write_text(str(len(multiprocessing.active_children())))
