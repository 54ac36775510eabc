"""The run's state as checkpoints save it (embodied/run_state.py): hand-built counters."""

from types import SimpleNamespace

from embodied.run_state import RunState, SavePoints


def test_counters_round_trip_and_leave_unset_optional_keys_out():
    state = RunState(iteration=3, env_steps=96, train_seconds=1.5, rounds=3)
    counters = state.counters()
    assert counters == {
        "iteration": 3,
        "env_steps": 96,
        "episodes": 0,
        "train_seconds": 1.5,
        "policy_version": 0,
        "rounds": 3,
        "evals": [],
        "before": None,
        "best": None,
    }
    assert RunState.from_counters(counters) == state
    state.evaluating = {"iteration": 2, "env_steps": 64, "train_seconds": 1.0}
    state.pipeline_stages = 2
    state.discarded_rounds = 1
    assert RunState.from_counters(state.counters()) == state
    assert state.at() == {"iteration": 3, "env_steps": 96, "train_seconds": 1.5}


def test_an_older_checkpoints_counters_load_with_defaults_and_unknown_keys_dropped():
    state = RunState.from_counters({"iteration": 2, "env_steps": 40, "retired_key": 7})
    assert (state.iteration, state.env_steps, state.rounds, state.evals) == (2, 40, 0, [])
    assert "retired_key" not in state.counters()


def test_the_state_is_copied_not_shared():
    counters = {"iteration": 1, "evals": [{"iteration": 1, "success_rate": 0.5}]}
    state = RunState.from_counters(counters)
    state.evals[0]["success_rate"] = 1.0
    snapshot = state.copy()
    state.evals.append({"iteration": 2})
    assert counters["evals"][0]["success_rate"] == 0.5 and len(snapshot.evals) == 1


class Recorder:
    """Stands in for the roles: random streams and a learner that records its saves."""

    def __init__(self):
        self.saves = []
        self.draws = 0
        self.learner = SimpleNamespace(save=self.save)

    def rng_state(self) -> dict:
        self.draws += 1
        return {"draw": self.draws}

    def save(self, run_dir, iteration, **kw):
        self.saves.append((iteration, kw["counters"]["iteration"], kw["rng"], kw["protect"]))


def test_save_points_save_the_completed_iteration_once_and_keep_best_and_evaluated(tmp_path):
    roles = Recorder()
    state = RunState()
    points = SavePoints(state, roles, tmp_path, meta={}, keep=2)
    points.save()  # iteration 0: nothing to save
    state.iteration = 1
    state.best = {"iteration": 1, "success_rate": 0.5}
    state.iteration = 2
    assert roles.saves == []
    points.complete(state)  # the streams as iteration 2 left them
    state.iteration = 3  # (moved on since: not what a save holds)
    points.save(evaluating=2)
    points.save()  # iteration 2 is saved already
    assert roles.saves == [(2, 2, {"draw": 2}, [1, 2])]
    assert points.saved == 2
