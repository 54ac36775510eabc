"""WorkerVecEnv's timeouts: a worker that hangs is killed, the others are stopped, the env is
closed, and the error names the simulator, the task, the worker, its environments and their
seeds; a worker that dies is named the same way, with how it ended; a core's user error is that
error, one line, as in one process. The cores are small numpy
counters defined here (module level: a spawned worker imports this module to build one).

Real time must pass for a pipe's timeout to fire, so these tests assert only that it fired (the
error, the killed worker), never how long it took; pytest-timeout's ceiling fails a timeout that
never fires instead of letting it hang. The seconds the error names are the deadline's own
(``WorkerVecEnv._timeout``), so the message shows a reset's ten step timeouts. No healthy answer
is due within a short timeout: the hung worker is worker 0, read first, and the calls before
the hang run with a timeout they cannot reach."""

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from clocks import CEILING_S

from embodied.schema import ActionSpec, EnvSpec, ObsSpec, UserError
from embodied.simulators.libero.config import LiberoConfig
from embodied.simulators.maniskill import ManiSkillConfig
from embodied.simulators.workers import WorkerTimeout, WorkerVecEnv

HANG = 99.0  # an action that makes a core's step never return (a simulator stuck in its solver)
EXIT = 77.0  # an action on which a core's process exits with code 3 (a crash in native code)
KILL = 55.0  # an action on which a core's process is killed by SIGKILL (the OOM killer's signal)
REFUSED = 33.0  # an action a core refuses with a UserError (bad input, as LIBERO's NaN check)
FAIL = 44.0  # an action on which a core raises (a solver that diverged)
LINGER = 22.0  # ... and leaves a thread running that keeps its process from ending
PIPE = 11.0  # an action on which a core raises BrokenPipeError (a renderer's socket, say)
HANG_SEED = 666  # a reset seed that makes a core's reset never return
STEP_TIMEOUT_S = 1.5
CEILING = pytest.mark.timeout(120)  # a timeout of seconds that never fires fails here


def _forever() -> None:
    while True:
        time.sleep(60)


class CountingCore:
    """n environments whose state counts the steps since their reset, speaking the workers'
    numpy protocol; it hangs on an action of HANG or a reset seed of HANG_SEED."""

    def __init__(self, n: int):
        self.count = np.zeros((n, 1), np.float32)
        self.spec = EnvSpec(
            obs=ObsSpec(state_names=("count",)),
            action=ActionSpec("joint_pos", ("a",), (-100.0,), (100.0,)),
            max_episode_steps=1000,
        )

    def _pack(self, ids: list[int]) -> dict:
        return {
            "state": self.count[ids].copy(),
            "images": {},
            "privileged": {},
            "instruction": ["count"] * len(ids),
        }

    def reset(self, ids: list[int], seeds: list) -> dict:
        if HANG_SEED in seeds:
            _forever()
        self.count[ids] = 0
        return self._pack(list(range(len(self.count))))

    def step(self, ids: list[int], actions: np.ndarray):
        if np.any(actions == HANG):
            _forever()
        if np.any(actions == EXIT):
            os._exit(3)
        if np.any(actions == KILL):
            os.kill(os.getpid(), signal.SIGKILL)
        if np.any(actions == REFUSED):
            raise UserError(f"Count-v0: action {REFUSED} refused")
        if np.any(actions == FAIL):
            raise ValueError("solver diverged")
        if np.any(actions == LINGER):
            threading.Thread(target=_forever).start()  # (not a daemon: the exit waits for it)
            raise ValueError("solver diverged")
        if np.any(actions == PIPE):
            raise BrokenPipeError("the renderer's socket closed")
        self.count[ids] += 1
        return self._pack(ids), np.zeros((len(ids), 4), np.float32), None

    def render(self, ids=None) -> np.ndarray:
        return np.zeros((len(self.count) if ids is None else len(ids), 4, 4, 3), np.uint8)

    def close(self) -> None:
        pass


def _gone(pid: int) -> bool:
    """No process with this id any more (killed and reaped: no orphan, no zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _counter_env(**kwargs) -> WorkerVecEnv:
    return WorkerVecEnv(CountingCore, 4, 2, name="Counter", task="Count-v0", **kwargs)


@CEILING
def test_a_worker_hung_in_a_step_is_killed_and_the_error_names_it():
    env = _counter_env(step_timeout_s=CEILING_S)  # (pytest-timeout's ceiling comes first)
    procs = list(env._procs)
    try:
        env.reset(seed=7)  # environments 0-3: seeds 7, 8, 9, 10
        env.reset(env_ids=torch.tensor([1]))  # environment 1 again, unseeded
        out = env.step(torch.zeros(4, 1))
        assert out.obs.state[:, 0].tolist() == [1, 1, 1, 1]  # a normal step before the hang
        env.step_timeout_s = STEP_TIMEOUT_S  # (the hang's step only)
        actions = torch.tensor([[HANG], [0.0], [0.0], [0.0]])  # environment 0: worker 0
        with pytest.raises(WorkerTimeout) as raised:
            env.step(actions)
    finally:
        env.close()
    assert isinstance(raised.value, RuntimeError)
    assert str(raised.value) == (
        "Counter Count-v0 worker 0 (environments 0-1, last reset seeds [7, None]) did not answer "
        "a step within 1.5 s; it was killed"
    )
    assert not any(p.is_alive() for p in procs)
    assert all(_gone(p.pid) for p in procs)
    assert procs[0].exitcode == -9  # the hung worker: killed
    assert procs[1].exitcode == 0  # the other: stopped cleanly (it closed its core and returned)
    with pytest.raises(RuntimeError, match="Counter Count-v0: the environments are closed"):
        env.step(torch.zeros(4, 1))


@CEILING
def test_a_cores_user_error_is_itself_and_a_non_finite_action_is_refused_before_any_step():
    """A core's UserError came back as "Counter worker failed:" and its traceback (exit 1, not
    the line of bad input); a NaN action reached the simulator (ManiSkill's controllers took it
    as their drive target)."""
    env = _counter_env()
    try:
        env.reset(seed=7)
        bad = torch.zeros(4, 1)
        bad[1, 0], bad[3, 0] = float("nan"), float("inf")
        with pytest.raises(UserError) as raised:
            env.step(bad)
        assert str(raised.value) == (
            "Counter Count-v0: the actions of environments [1, 3] are not finite (first: [nan])"
        )
        assert env.step(torch.zeros(4, 1)).obs.state[:, 0].tolist() == [1, 1, 1, 1]  # (none sent)
        with pytest.raises(UserError) as raised:
            env.step(torch.tensor([[0.0], [0.0], [REFUSED], [0.0]]))
        assert str(raised.value) == f"Count-v0: action {REFUSED} refused"
    finally:
        env.close()


@CEILING
def test_a_hung_reset_gets_ten_times_the_step_timeout():
    env = _counter_env(step_timeout_s=0.2)
    procs = list(env._procs)
    try:
        with pytest.raises(WorkerTimeout) as raised:
            env.reset(seed=[HANG_SEED, 2, 3, 4])  # environment 0: worker 0, read first
    finally:
        env.close()
    assert str(raised.value) == (
        f"Counter Count-v0 worker 0 (environments 0-1, last reset seeds [{HANG_SEED}, 2]) did "
        "not answer a reset within 2 s; it was killed"
    )
    assert all(_gone(p.pid) for p in procs)


@CEILING
@pytest.mark.parametrize("action, how", [(EXIT, "exit code 3"), (KILL, "killed by SIGKILL")])
def test_a_worker_that_dies_mid_run_is_named_with_its_environments_seeds_and_end(action, how):
    """It said "a Counter worker process died (see its output above; ... `if __name__ ==
    '__main__':`)": a start-up hint, mid-run, and nothing of which worker or how."""
    env = _counter_env()
    procs = list(env._procs)
    try:
        env.reset(seed=[4, 5, 6, 7])
        env.step(torch.zeros(4, 1))
        with pytest.raises(RuntimeError) as raised:
            env.step(torch.tensor([[0.0], [0.0], [action], [0.0]]))  # environment 2: worker 1
    finally:
        env.close()
    assert str(raised.value) == (
        f"Counter Count-v0 worker 1 (environments 2-3, last reset seeds [6, 7]) died in a step "
        f"({how})"
    )
    assert all(_gone(p.pid) for p in procs) and procs[0].exitcode == 0  # the other: stopped
    with pytest.raises(RuntimeError, match="Counter Count-v0: the environments are closed"):
        env.step(torch.zeros(4, 1))


class EndingCore(CountingCore):
    """CountingCore whose episodes end at 2 steps, each reset there by the core itself."""

    def step(self, ids: list[int], actions: np.ndarray):
        obs, scalars, _ = super().step(ids, actions)
        scalars[:, 2] = self.count[ids, 0] >= 2  # truncated
        final = obs if scalars[:, 2].any() else None
        self.count[[i for i, done in zip(ids, scalars[:, 2]) if done]] = 0
        return self._pack(ids), scalars, final


def test_an_episode_the_worker_reset_itself_is_not_named_with_the_rounds_seed():
    """The message named the seeds of the round's reset after a worker's own reset: a user who
    reset with one got another episode than the one that hung."""
    with WorkerVecEnv(EndingCore, 2, 0) as env:
        env.reset(seed=[10, 11])
        env.step(torch.zeros(2, 1))
        assert env._held(0) == "environments 0-1, last reset seeds [10, 11]"
        assert env.step(torch.zeros(2, 1)).truncated.tolist() == [True, True]
        assert env._held(0) == "environments 0-1, last reset seeds ['auto-reset', 'auto-reset']"
        env.reset(seed=5, env_ids=torch.tensor([1]))  # (environment i: seed + i)
        assert env._held(0) == "environments 0-1, last reset seeds ['auto-reset', 6]"


def test_in_process_cores_step_without_a_timeout_and_a_bad_timeout_is_refused():
    with WorkerVecEnv(CountingCore, 2, 0, step_timeout_s=0.001) as env:
        env.reset(seed=0)
        assert env.step(torch.zeros(2, 1)).obs.state[:, 0].tolist() == [1, 1]
    with pytest.raises(ValueError, match="step_timeout_s: must be > 0"):
        WorkerVecEnv(CountingCore, 2, 0, step_timeout_s=0)


@pytest.mark.parametrize("config", [ManiSkillConfig, LiberoConfig])
def test_simulator_configs_carry_a_positive_step_timeout(config):
    assert config().step_timeout_s == 120.0
    with pytest.raises(ValueError, match=r"^step_timeout_s: must be > 0 \(seconds\), got -1"):
        config(step_timeout_s=-1).validate()


@CEILING
def test_a_worker_killed_between_calls_or_whose_core_raises_is_named_and_the_env_closed():
    """A worker killed while idle (an out-of-memory kill during an update) gave a bare
    BrokenPipeError at the next send, the env left open; a core's exception came back as
    "Counter worker failed:" with no worker, environments or seeds, the other worker running."""
    for failure in ("killed", "raised"):
        env = _counter_env()
        procs = list(env._procs)
        try:
            env.reset(seed=[4, 5, 6, 7])
            actions = torch.zeros(4, 1)
            if failure == "killed":
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].join()
            else:
                actions[2, 0] = FAIL  # environment 2: worker 1
            with pytest.raises(RuntimeError) as raised:
                env.step(actions)
        finally:
            env.close()
        said = "Counter Count-v0 worker 1 (environments 2-3, last reset seeds [6, 7])"
        if failure == "killed":
            assert str(raised.value) == f"{said} died in a step (killed by SIGKILL)"
        else:
            assert str(raised.value).startswith(f"{said} failed in a step:\nTraceback")
            assert str(raised.value).endswith("ValueError: solver diverged\n")
        assert env._closed and all(_gone(p.pid) for p in procs) and procs[0].exitcode == 0


@CEILING
def test_a_step_timeout_of_weeks_still_polls_and_ids_out_of_order_are_refused():
    """select's timeout is a C int of milliseconds: a reset's ten times a step timeout of 3e5 s
    overflowed it (OverflowError at every reset). Answers are joined in worker order: ids out
    of order gave each environment another's row."""
    with _counter_env(step_timeout_s=3e5) as env:
        assert env.reset(seed=0).state.shape == (4, 1)
        env.step_async(torch.zeros(1, 1), torch.tensor([3]))
        assert env.step_wait(torch.tensor([3])).obs.state[:, 0].tolist() == [1]
        with pytest.raises(
            ValueError, match=r"env_ids: must be ascending and distinct, got \[3, 0\]"
        ):
            env.step_async(torch.zeros(2, 1), torch.tensor([3, 0]))
        assert env.render(torch.tensor([3, 0])).shape == (2, 4, 4, 3)  # (placed by position)


class NeverStarts(CountingCore):
    def __init__(self, n: int):
        _forever()  # (an asset load or a renderer's start that hangs)


@CEILING
def test_a_worker_that_does_not_start_is_a_timeout_naming_it(monkeypatch):
    """It said to guard the script with `if __name__ == '__main__':`, which makes a worker die at
    once (tested apart), not hang; and named no task or worker."""
    import embodied.simulators.workers as workers

    monkeypatch.setattr(workers, "START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(workers, "STOP_TIMEOUT_S", 1.0)
    with pytest.raises(WorkerTimeout) as raised:
        WorkerVecEnv(NeverStarts, 2, 1, name="Counter", task="Count-v0")
    assert str(raised.value) == (
        "Counter Count-v0 worker 0 (environments 0-1) did not start within 1 s; it was killed"
    )


@CEILING
def test_a_core_that_raises_and_lingers_is_killed_and_one_in_process_raises_its_own_error(
    monkeypatch,
):
    """A worker whose core raised but whose process does not end (a thread of its own left
    running) was left alive, its handle dropped; a core in this process raising BrokenPipeError
    came back as an IndexError (taken for a dead worker's pipe)."""
    import embodied.simulators.workers as workers

    monkeypatch.setattr(workers, "STOP_TIMEOUT_S", 1.0)
    env = _counter_env()
    procs = list(env._procs)
    try:
        env.reset(seed=0)
        with pytest.raises(RuntimeError, match="worker 1 .* failed in a step"):
            env.step(torch.tensor([[0.0], [0.0], [LINGER], [0.0]]))
    finally:
        env.close()
    assert all(_gone(p.pid) for p in procs)
    with WorkerVecEnv(CountingCore, 2, 0) as env:
        env.reset(seed=0)
        with pytest.raises(BrokenPipeError, match="the renderer's socket closed"):
            env.step(torch.tensor([[PIPE], [0.0]]))


class TimeLimitCore(CountingCore):
    """Episodes of 2 steps; a reset takes 0.4 s an environment, the worker's own in a step too."""

    def __init__(self, n: int):
        super().__init__(n)
        self.spec = dataclasses.replace(self.spec, max_episode_steps=2)

    def reset(self, ids: list[int], seeds: list) -> dict:
        time.sleep(0.4 * len(ids))
        return super().reset(ids, seeds)

    def step(self, ids: list[int], actions: np.ndarray):
        obs, scalars, _ = super().step(ids, actions)
        scalars[:, 2] = self.count[ids, 0] >= 2  # truncated
        ended = [i for i, done in zip(ids, scalars[:, 2]) if done]
        time.sleep(0.4 * len(ended))
        self.count[ended] = 0
        return self._pack(ids), scalars, obs if ended else None


@CEILING
def test_a_step_that_reaches_the_time_limit_has_a_resets_time():
    """Every round's last step resets its environments in their workers (ManiSkill, LIBERO):
    it was judged by the step timeout, and a lowered one killed healthy workers there."""
    with WorkerVecEnv(TimeLimitCore, 4, 2, name="Counter", step_timeout_s=0.5) as env:
        env.reset(seed=0)  # (0.8 s a worker: within a reset's 5 s)
        env.step(torch.zeros(4, 1))
        assert env.step(torch.zeros(4, 1)).truncated.tolist() == [True] * 4  # (0.8 s: resets)
        assert env.step(torch.zeros(4, 1)).obs.state[:, 0].tolist() == [1.0] * 4
