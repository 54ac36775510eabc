"""``embodied replay RUN --iteration N``: run a recorded iteration's update again, offline, from
the learner's state before it and the rounds it was given (embodied/recording.py), and compare
it with the run: the update's metrics as logged, and the weights after it (a digest). On the
machine and backend that recorded it they match bit for bit; ``--rtol`` allows a relative
difference in the metrics elsewhere (the weights' digest compares bit for bit only: the command
says whether it is equal, and the metrics decide). Not bit for bit: an update shared by
data-parallel actor workers (each summed its share of every minibatch; the command says so),
one recorded on a GPU and replayed on the CPU (``offload_optimizer``'s bookkeeping metric is not
compared). A megatron run's update is replayed at its TP size (a bf16 run's from its float32
main weights, which the record keeps beside the bf16 ones that acted).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from embodied import numerics
from embodied.recording import (
    Record,
    RecordedRounds,
    read_record,
    restore_before,
    weights_digest,
)
from embodied.schema import UserError

# what an update logs of its own bookkeeping: the optimizer state offloaded to the host (0 where
# the learner is on the CPU, as a replay of a GPU run's record may be)
BOOKKEEPING = ("optimizer/offloaded_mb",)


def record_config(record: RecordedRounds):
    """The recorded run's ``TrainConfig``, as its record kept it."""
    from embodied.config import compose
    from embodied.train_config import TrainConfig

    return compose(TrainConfig, [("the record", record.meta["config"])])


def replay(run_dir: Path, iteration: int, device: str = "cpu") -> tuple[Record, dict, str]:
    """The recorded update of ``iteration`` run again: (the record, the update's metrics, the
    digest of the weights after it)."""
    from embodied.roles import learner_for
    from embodied.schema import EnvSpec

    record = read_record(run_dir, iteration, device)
    cfg = record_config(record)
    cfg.cluster.enabled = False  # (the update in this process, as one actor worker ran it)
    cfg.runner.record_rollouts = 0  # (a replay records nothing)
    # the precision the run trained in: "auto" of a GPU run's bf16 was float32 on the CPU
    cfg.trainer.precision = record.meta.get("precision", cfg.trainer.precision)
    if cfg.runner.deterministic:  # the run's portable kernels (the CLI starts over pinned)
        numerics.pin()
    numerics.setup(cfg.runner.torch_threads)  # (the run's threads: another count sums apart)
    spec = EnvSpec.from_dict(record.meta["spec"])
    task_of_env = torch.tensor(record.meta["task_of_env"], dtype=torch.long)
    # (at the run's trainer.tensor_parallel: the other TP ranks are processes of this one)
    learner = learner_for(cfg, spec, task_of_env, torch.device(device))
    try:
        check_reference(learner, record)
        restore_before(learner, record)
        for batch in record.rounds:
            learner.add_round(batch)
        metrics = learner.update()
        digest = weights_digest(learner.engine.torch_policy)
    finally:
        learner.close()
    return record, {k: float(v) for k, v in metrics.items()}, digest


def same_reference(learner, record: RecordedRounds) -> bool:
    """Whether the learner's KL reference (GRPO's ``kl_coef > 0``) is the recorded run's, as far
    as the record says (one recorded before its digest was kept says nothing)."""
    from embodied.roles import reference_digest

    recorded = record.meta.get("reference_digest")
    return recorded is None or reference_digest(learner) == recorded


def check_reference(learner, record: RecordedRounds) -> None:
    """A ``UserError`` where the KL reference the learner was built with (GRPO's ``kl_coef >
    0``, from ``runner.init_from`` or the seed: a record does not hold it) is not the recorded
    run's: the replayed update would differ with nothing else to show why."""
    if not same_reference(learner, record):
        init_from = record_config(record).runner.init_from
        source = f"runner.init_from={init_from}" if init_from else "the seed's initial weights"
        raise UserError(
            f"{record.path}: the KL penalty's reference ({source}) is not the recorded run's "
            "(its checkpoint changed since?); the update cannot be replayed"
        )


def differences(
    logged: dict, replayed: dict, rtol: float = 0.0, weights: tuple[str, str] | None = None
) -> list[str]:
    """What differs between the logged and the replayed update, one phrase each (empty: they
    match): a metric beyond ``rtol`` (relative), one missing on either side, the weights. The
    bookkeeping metrics (``BOOKKEEPING``: not the update's numbers) are not compared."""
    out = []
    for key in sorted((set(logged) | set(replayed)) - set(BOOKKEEPING)):
        if key not in replayed or key not in logged:
            out.append(f"{key} only {'logged' if key in logged else 'replayed'}")
            continue
        a, b = logged[key], replayed[key]
        same = (math.isnan(a) and math.isnan(b)) or a == b
        if not same and not (rtol and math.isclose(a, b, rel_tol=rtol)):
            out.append(f"{key} logged {a!r}, replayed {b!r}")
    if weights is not None and weights[0] != weights[1]:
        out.append(
            f"weights after the update differ (digest {weights[0][:12]} vs {weights[1][:12]})"
        )
    return out
