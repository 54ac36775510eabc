"""Rollout records: an iteration's collected rounds with the learner's state before its update, so
that the update can be run again offline (``embodied replay``) and compared with the run's.

``runner.record_rollouts: N`` records every Nth iteration; an update whose loss is not finite
(the first of a streak; the runner then stops the run), or whose gradient norm (the mean over its
steps, before clipping) is over ``runner.spike_factor`` times the median of the last
``SPIKE_WINDOW`` iterations' positive ones (``spikes``), is recorded too, and such records are
never pruned. The learner keeps what a record needs from the first round of each iteration on
(``Pending``: host copies of the rounds as collected, and of its state before the update); the
runner, which sees the update's metrics, decides whether it is written (``RecordPolicy``).

A record is ``RUN/rollouts/iter_NNNNNN/``:
- ``rounds.safetensors.zst``: every round's tensors (``r<i>/<field>``), zstd-compressed
  (lossless: a replay must see the log-probabilities' inputs as they were);
- ``learner.safetensors``: the policy's state before the update (``main/<name>``: a bf16
  megatron run's float32 main weights), and the learner's stream;
- ``optimizer.pt``: the optimizer's state before the update;
- ``record.json``: the iteration, why it was recorded, the learning rate, each round's
  instructions, the update's metrics as logged, and a digest of the weights after it.
Files are written to a staging folder, flushed to disk and renamed whole: a crash leaves no half
record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save, save_file

from embodied.checkpoint import fsync
from embodied.logger import read_metrics
from embodied.record_files import prune_records, record_dir
from embodied.rollout import RolloutBatch
from embodied.schema import Observation, UserError

MAIN = "main"  # learner.safetensors' prefix of a bf16 run's main weights
SET_BY_ADVANTAGES = ("advantages", "returns", "sample_mask")  # (computed again on replay)
SPIKE_WINDOW = 20  # iterations whose gradient norms make the median a spike is measured by
FORMAT = "embodied-rollout-record-v1"
# what a replay reads from record.json
NON_FINITE_TEXTS = ("nan", "inf", "-inf")  # (how record.json writes a metric that is not finite)
META_KEYS = (
    "iteration",
    "instructions",
    "stream_seed",
    "lr",
    "metrics",
    "digest_after",
    "config",
    "spec",
    "task_of_env",
)


class RecordError(UserError):
    """A record that cannot be read; ``str()`` is one line naming the file."""


def batch_tensors(batch: RolloutBatch, prefix: str) -> dict[str, torch.Tensor]:
    """The round's tensors as it was collected (before its advantages), on the host, by name."""
    out = {f"{prefix}obs/{k}": v for k, v in batch.obs.tensors().items()}
    out.update({f"{prefix}extras/{k}": v for k, v in batch.extras.items()})
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor) and f.name not in SET_BY_ADVANTAGES:
            out[f"{prefix}{f.name}"] = value
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def batch_from(
    tensors: dict[str, torch.Tensor], prefix: str, instructions, device="cpu"
) -> RolloutBatch:
    """A round back from ``batch_tensors``' names, on ``device``."""
    tensors = {k: v.to(device) for k, v in tensors.items() if k.startswith(prefix)}

    def under(part: str) -> dict[str, torch.Tensor]:
        start = f"{prefix}{part}/"
        return {k[len(start) :]: v for k, v in tensors.items() if k.startswith(start)}

    obs = under("obs")
    observation = Observation(
        state=obs["state"],
        instruction=[],
        images={k[len("images/") :]: v for k, v in obs.items() if k.startswith("images/")},
        privileged={
            k[len("privileged/") :]: v for k, v in obs.items() if k.startswith("privileged/")
        },
    )
    plain = {
        f.name: tensors[f"{prefix}{f.name}"]
        for f in dataclasses.fields(RolloutBatch)
        if f"{prefix}{f.name}" in tensors
    }
    return RolloutBatch(
        obs=observation, instructions=tuple(instructions), extras=under("extras"), **plain
    )


def weights_digest(policy: torch.nn.Module) -> str:
    """``state_digest`` of the policy's state."""
    return state_digest(policy.state_dict())


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict (names, dtypes, shapes, bytes), by name (a safetensors file
    gives its entries sorted)."""
    digest = hashlib.sha256()
    for key, tensor in sorted(state.items()):
        host = tensor.detach().to("cpu").contiguous()
        digest.update(f"{key}:{host.dtype}:{tuple(host.shape)}".encode())
        digest.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Pending:
    """What the learner keeps of the iteration in progress for a record: host copies of its
    state before the update and of each round as it was collected."""

    model: dict[str, torch.Tensor]
    optimizer: dict
    lr: float
    stream: dict
    main_weights: dict[str, torch.Tensor]  # (a bf16 megatron run's float32 weights; else {})
    rounds: list[dict[str, torch.Tensor]] = field(default_factory=list)
    instructions: list[tuple[str, ...]] = field(default_factory=list)
    digest_after: str = ""  # the weights after the update, once it has run

    @classmethod
    def before(cls, engine, stream) -> Pending:
        model = {
            k: v.detach().to("cpu", copy=True) for k, v in engine.torch_policy.state_dict().items()
        }
        mains = {k: v.to("cpu", copy=True) for k, v in engine.main_weights().items()}
        return cls(model, engine.whole_optimizer_state(), engine.lr, stream.state(), mains)

    def add(self, batch: RolloutBatch) -> None:
        self.rounds.append(batch_tensors(batch, f"r{len(self.rounds)}/"))
        self.instructions.append(tuple(batch.instructions))

    def write(
        self, run_dir: Path, iteration: int, reason: str, metrics: dict, context: dict
    ) -> Path:
        """``RUN/rollouts/iter_NNNNNN`` (staged, then renamed whole); ``context``: what a replay
        builds the learner from (the spec, each environment's task). A write that fails (a full
        disk: ``OSError``, or torch's and safetensors' own errors) leaves no staged files."""
        final = record_dir(run_dir, iteration)
        staging = final.with_name(final.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            self._stage(staging, iteration, reason, metrics, context)
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
        except BaseException:  # (whatever stopped it: no half record stays to fill the disk)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync(final.parent)
        fsync(run_dir)  # (the rollouts folder itself may be new)
        return final

    def _stage(self, staging: Path, iteration: int, reason: str, metrics: dict, context: dict):
        """The record's files in ``staging``, each flushed to disk, and the folder too."""
        import zstandard

        staging.mkdir(parents=True)
        rounds = {k: v for part in self.rounds for k, v in part.items()}
        packed = zstandard.ZstdCompressor(level=3).compress(save(rounds))
        (staging / "rounds.safetensors.zst").write_bytes(packed)
        stream = {f"stream/{k}": v for k, v in self.stream.items() if isinstance(v, torch.Tensor)}
        mains = {f"{MAIN}/{k}": v for k, v in self.main_weights.items()}
        save_file({**self.model, **mains, **stream}, staging / "learner.safetensors")
        torch.save(self.optimizer, staging / "optimizer.pt")
        meta = {
            "format": FORMAT,
            "iteration": iteration,
            "reason": reason,
            "lr": self.lr,
            "stream_seed": self.stream["seed"],
            "instructions": [list(i) for i in self.instructions],
            "metrics": {
                k: v if math.isfinite(v) else str(v)  # ("nan", "inf": strict JSON; float() reads)
                for k, v in metrics.items()
                if isinstance(v, (int, float))
            },
            "digest_after": self.digest_after,
            **context,
        }
        (staging / "record.json").write_text(json.dumps(meta, indent=1))
        for path in (*staging.iterdir(), staging):  # on disk before the rename makes it a record
            fsync(path)


@dataclass
class RecordedRounds:
    """A record's rounds and metadata, read back without the learner's state (episodes, the
    report and the re-simulation need no more)."""

    path: Path
    meta: dict
    rounds: list[RolloutBatch]


@dataclass
class Record(RecordedRounds):
    """A record read back whole: also the learner's state before the update."""

    model: dict[str, torch.Tensor]
    stream: dict
    optimizer: dict
    main_weights: dict[str, torch.Tensor]  # (a bf16 megatron run's float32 weights; else {})


def restore_before(learner, record: Record) -> None:
    """``learner`` (every TP rank of it) as it was before the recorded update: weights,
    optimizer, learning rate and random stream."""
    model = {**record.model, **record.main_weights}  # (a bf16 run goes on from the float32 ones)
    learner.restore_record(model, record.optimizer, record.meta["lr"], record.stream)


def record_meta(run_dir: Path, iteration: int) -> dict:
    """The metadata of ``iteration``'s record (record.json; ``RecordError`` naming the file
    that is missing or damaged)."""
    path = record_dir(run_dir, iteration)
    if not path.is_dir():
        raise RecordError(f"{path}: no record of iteration {iteration} (runner.record_rollouts)")
    meta = _read(path / "record.json", lambda p: json.loads(p.read_text()))
    if not isinstance(meta, dict):
        raise RecordError(f"{path / 'record.json'}: damaged (not a JSON object)")
    if meta.get("format", FORMAT) != FORMAT:
        raise RecordError(
            f"{path / 'record.json'}: format {meta['format']!r}, not {FORMAT!r} (another version "
            "of embodied wrote it)"
        )
    missing = sorted(set(META_KEYS) - set(meta))
    if missing:
        raise RecordError(f"{path / 'record.json'}: damaged (no {', '.join(missing)})")
    if not isinstance(meta["instructions"], list) or not isinstance(meta["config"], dict):
        raise RecordError(f"{path / 'record.json'}: damaged (its instructions or config)")
    if not isinstance(meta["metrics"], dict):
        raise RecordError(f"{path / 'record.json'}: damaged (its metrics are not a JSON object)")
    for key, value in meta["metrics"].items():
        if isinstance(value, str):  # (strict JSON: a number that is not finite is its text)
            if value not in NON_FINITE_TEXTS:
                raise RecordError(f"{path / 'record.json'}: damaged (metric {key} is {value!r})")
            meta["metrics"][key] = float(value)
    return meta


def read_rounds(run_dir: Path, iteration: int, device="cpu") -> RecordedRounds:
    """The rounds of ``iteration``'s record on ``device`` and its metadata (``RecordError``
    naming the file that is missing or damaged)."""
    path = record_dir(run_dir, iteration)
    meta = record_meta(run_dir, iteration)
    tensors = _read(path / "rounds.safetensors.zst", lambda p: load(_unzstd(p.read_bytes())))
    found = {key.split("/", 1)[0] for key in tensors}
    if found != {f"r{i}" for i in range(len(meta["instructions"]))}:
        raise RecordError(
            f"{path}: damaged (record.json lists {len(meta['instructions'])} rounds, "
            f"rounds.safetensors.zst holds {len(found)})"
        )
    rounds = [
        batch_from(tensors, f"r{i}/", instructions, device)
        for i, instructions in enumerate(meta["instructions"])
    ]
    return RecordedRounds(path, meta, rounds)


def read_record(run_dir: Path, iteration: int, device="cpu") -> Record:
    """The record of ``iteration`` whole: its rounds on ``device`` and the learner's state
    before the update (``RecordError`` naming the file that is missing or damaged)."""
    recorded = read_rounds(run_dir, iteration, device)
    path = recorded.path
    learner = _read(path / "learner.safetensors", load_file)
    optimizer = _read(path / "optimizer.pt", lambda p: torch.load(p, weights_only=True))
    if "stream/cpu" not in learner:
        raise RecordError(f"{path / 'learner.safetensors'}: damaged (no stream/cpu)")
    stream = {"seed": recorded.meta["stream_seed"], "cpu": learner.pop("stream/cpu")}
    stream["cuda"] = learner.pop("stream/cuda", None)
    start = f"{MAIN}/"
    mains = {k[len(start) :]: learner.pop(k) for k in list(learner) if k.startswith(start)}
    return Record(path, recorded.meta, recorded.rounds, learner, stream, optimizer, mains)


def _read(path: Path, how):
    try:
        return how(path)
    except FileNotFoundError:
        raise RecordError(f"{path}: missing from the record") from None
    except Exception as error:
        raise RecordError(f"{path}: damaged ({type(error).__name__})") from None


def _unzstd(packed: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(packed)


def not_finite(metrics: dict) -> dict[str, float]:
    """An update's losses and gradient norm (``policy/grad_norm``) that are not finite, by name
    (empty: the update is finite)."""
    watched = {
        k: v
        for k, v in metrics.items()
        if (k.endswith("loss") or k == "policy/grad_norm") and isinstance(v, (int, float))
    }
    return {k: v for k, v in watched.items() if not math.isfinite(v)}


def spikes(norm: float, window: list[float], factor: float) -> bool:
    """Whether a gradient norm is over ``factor`` times the median of the positive norms in
    ``window`` (at least two; ``factor`` 0: never). A norm of 0 (an update without a gradient:
    GRPO's groups that all score alike, with no KL term) says nothing of the scale: against a
    median of 0, any gradient at all would be a spike."""
    scale = [n for n in window if n > 0]
    return factor > 0 and len(scale) >= 2 and norm > factor * statistics.median(scale)


@dataclass
class RecordPolicy:
    """Which iterations are written (the runner asks after each update): every ``every``-th
    (0: none), and any whose gradient norm spikes, or whose loss is not finite where the one
    before it was (the first of a streak: those after it add nothing to replay, only disk)."""

    every: int
    spike_factor: float
    grad_norms: list[float] = field(default_factory=list)  # the last SPIKE_WINDOW iterations'
    not_finite_before: bool = False  # the iteration before's update was not finite

    def reason(self, iteration: int, metrics: dict) -> str | None:
        """Why ``iteration`` is recorded ("non-finite", "spike", "every"), or None."""
        norm = metrics.get("policy/grad_norm")
        window = self.grad_norms[-SPIKE_WINDOW:]  # the iterations before this one
        finite = not not_finite(metrics)
        if norm is not None and math.isfinite(norm):
            self.grad_norms = [*window, float(norm)][-SPIKE_WINDOW:]
        streak, self.not_finite_before = self.not_finite_before, not finite
        if not finite and not streak:
            return "non-finite"
        if finite and norm is not None and spikes(norm, window, self.spike_factor):
            return "spike"
        if self.every and iteration % self.every == 0:
            return "every"
        return None


class RunRecords:
    """The runner's side of recording: after each update, whether the learner writes the
    iteration's record (``RecordPolicy``), and the records kept (``runner.keep_rollouts``: the
    newest of those recorded every Nth iteration; non-finite and spiking ones always stay)."""

    def __init__(self, runner_cfg, run_dir: Path, learner, event=None):
        self.policy = RecordPolicy(runner_cfg.record_rollouts, runner_cfg.spike_factor)
        self.policy.grad_norms = logged_grad_norms(Path(run_dir))  # (a resumed run's window)
        self.keep = runner_cfg.keep_rollouts
        self.run_dir = Path(run_dir)
        self.learner = learner
        self.event = event or (lambda kind, detail: None)  # (the run's events: kind, detail)

    def after_update(self, iteration: int, metrics: dict, counters: dict) -> str | None:
        """The learner writes or drops the record of ``iteration`` (``counters``: the run's
        after it); why it was written (None: not asked for, or lost). A record that could not
        be written (a full disk) is one line and a ``record_failed`` event; the run goes on."""
        reason = self.policy.reason(iteration, metrics)
        failed = self.learner.keep_record(self.run_dir, iteration, reason, metrics, counters)
        if failed:
            print(f"the record of iteration {iteration} ({reason}) was not written: {failed}")
            self.event("record_failed", f"iteration {iteration} ({reason}): {failed}")
            return None
        if reason is not None:
            try:
                prune_records(self.run_dir, self.keep)
            except OSError as error:  # (a record busy on NFS, say: it stays, as the run does)
                print(f"older rollout records were not pruned: {error}")
                self.event("record_failed", f"pruning after iteration {iteration}: {error}")
        return reason


def logged_grad_norms(run_dir: Path) -> list[float]:
    """The last ``SPIKE_WINDOW`` finite gradient norms in the run's metrics.jsonl (empty for a
    new run): a resumed run judges spikes against the iterations before it stopped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    norms = [row.get("policy/grad_norm") for row in read_metrics(path)]  # (null: NaN)
    norms = [n for n in norms if isinstance(n, float) and math.isfinite(n)]
    return norms[-SPIKE_WINDOW:]
