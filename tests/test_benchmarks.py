"""Numbers the benchmark scripts derive from their measurements, on hand-computed cases."""

import json
import re
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load


def test_vla_inferences_memory_column_counts_what_acting_allocates(monkeypatch):
    """A policy whose act touches 256 MiB and frees it: the column read ~0 (the peak was taken
    as the base after the warm-up act, which already reached it)."""
    vla_inference = load("vla_inference")

    class Hungry(torch.nn.Module):
        def act(self, obs, **kw):
            return torch.ones(2**26).sum()  # f32 [64 Mi]: 256 MiB, written, freed at return

    class Queue(list):
        put = list.append

    monkeypatch.setattr(vla_inference, "_policy", lambda *args: Hungry())
    results = Queue()
    vla_inference._run("hungry", 1, "cpu", 32, 2, torch.get_num_threads(), "", results)
    ((_, peak_mib, _),) = results
    assert 240 < peak_mib < 600


def test_the_pipelining_bound_peaks_at_1_5_where_simulation_is_half_the_inference():
    """2 stages, lockstep S + I: a stage waits for its simulation and half the inference
    (S + I/2), and the one rollout worker still infers for all (I)."""
    bound = load("scaling").pipelining_bound
    assert bound(1.0, 2.0) == pytest.approx(1.5)  # S = I/2: both limits are 2 (3 / 2)
    assert bound(11.0, 1.5) == pytest.approx(12.5 / 11.75)  # simulation-bound (the default VLA)
    assert bound(1.0, 10.0) == pytest.approx(11.0 / 10.0)  # inference-bound
    assert bound(9.69, 8.28) == pytest.approx(17.97 / 13.83)
    grid = [bound(s / 10, 1.0) for s in range(1, 40)]
    assert max(grid) == pytest.approx(1.5)  # (at s = 0.5)
    # a lockstep round of 12 s with 1 s lost between calls: that second can be hidden too
    assert bound(9.0, 2.0, 12.0) == pytest.approx(12.0 / 10.0)


def test_stages_inside_one_env_worker_can_gain_up_to_2x_where_simulation_equals_inference():
    """One env worker simulates a stage while the rollout worker acts for the other: a round
    takes the busier of the two, max(S, I)."""
    bound = load("scaling").pipelining_bound
    assert bound(1.0, 1.0, stages_in_worker=True) == pytest.approx(2.0)
    assert bound(3.0, 1.0, stages_in_worker=True) == pytest.approx(4.0 / 3.0)  # simulation-bound
    assert bound(1.0, 4.0, stages_in_worker=True) == pytest.approx(5.0 / 4.0)  # inference-bound
    grid = [bound(s / 10, 1.0, stages_in_worker=True) for s in range(1, 40)]
    assert max(grid) == pytest.approx(2.0)  # (at s = 1)
    assert bound(2.0, 2.0, 4.5, stages_in_worker=True) == pytest.approx(4.5 / 2.0)


def test_time_to_success_is_the_first_evaluation_at_the_threshold(tmp_path):
    rows = [
        {"env_steps": 100, "iteration": 1, "time/minutes": 0.5},
        {"env_steps": 100, "iteration": 1, "eval/success_rate": 0.5},
        {"env_steps": 200, "iteration": 2, "time/minutes": 1.0},
        {"env_steps": 200, "iteration": 2, "eval/success_rate": 0.92},
        {"env_steps": 300, "iteration": 3, "time/minutes": 1.5},
        {"env_steps": 300, "iteration": 3, "eval/success_rate": 0.95},
        {"env_steps": 300, "iteration": 3, "eval/success_rate": 0.97, "final": True},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tts = load("time_to_success")
    points = tts.curve(tmp_path)
    assert [p["minutes"] for p in points] == [0.5, 1.0, 1.5]  # (not the final evaluation)
    got = tts.reached(points, 0.9, raw_rate=10.0)  # 200 steps at 10 world-steps/s: 20 s
    assert got["reached"] and got["env_steps"] == 200 and got["minutes"] == 1.0
    assert got["lower_bound_minutes"] == pytest.approx(200 / 10 / 60)
    never = tts.reached(points, 0.99, raw_rate=None)  # "not reached" is a result: where it ended
    assert not never["reached"] and never["env_steps"] == 300 and never["success"] == 0.95
    # from an SFT checkpoint: the evaluation before RL (iteration 0) is a point, at 0 minutes
    before = {"env_steps": 0, "iteration": 0, "eval/success_rate": 0.95}
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [before, *rows]))
    got = tts.reached(tts.curve(tmp_path), 0.9, raw_rate=None)
    assert got["reached"] and got["env_steps"] == 0 and got["minutes"] == 0.0


def test_the_sleeping_simulator_passes_the_contract_and_pays_the_first_action():
    """benchmarks/latency_env.py, the scaling benchmark's latency-bound simulator (0 s steps)."""
    import torch

    from embodied.contract import check_env

    env = load("latency_env").SleepingEnv(3, step_s=0.0, episode_steps=4)
    check_env(env)
    env.reset(seed=0)
    out = env.step(torch.tensor([[0.5, 0.0], [-1.0, 0.0], [0.25, 1.0]]))
    assert out.reward.tolist() == [0.5, -1.0, 0.25]
    assert out.obs.state.tolist() == [[1.0]] * 3
    for _ in range(3):
        out = env.step(torch.zeros(3, 2))
    assert out.truncated.tolist() == [True] * 3 and out.ended.tolist() == [0, 1, 2]
    assert out.final_obs.state[:, 0].tolist() == [4.0] * 3
    assert out.obs.state[:, 0].tolist() == [0.0] * 3


def test_a_host_sync_is_counted_at_the_innermost_line_outside_torch():
    """benchmarks/host_syncs.py: a sync raised in torch's own Python code is named by the line
    of ours that called it; one raised in ours by its own line."""
    from traceback import FrameSummary

    host_syncs = load("host_syncs")
    site_of = partial(host_syncs.site_of, torch_dir=Path("/opt/torch/site-packages/torch"))
    ours = FrameSummary("/x/simulators/mujoco/warp_env.py", 253, "buffer_peaks")
    inside_torch = FrameSummary("/opt/torch/site-packages/torch/functional.py", 99, "unique")
    hook = FrameSummary("/usr/lib/python3.11/warnings.py", 40, "_showwarnmsg")
    runner = FrameSummary("/x/embodied/rollout.py", 452, "record")
    stack = [runner, ours, inside_torch, hook]
    assert site_of(stack, "/opt/torch/site-packages/torch/functional.py", 99) == "warp_env.py:253"
    assert site_of([runner, hook], "/x/embodied/rollout.py", 452) == "rollout.py:452"
    assert site_of([inside_torch], "/v/torch/functional.py", 99) == "functional.py:99"
    # another package beside torch's, in a folder named torch (the GPU image's venv): not torch
    warp = FrameSummary("/opt/torch/site-packages/warp/context.py", 7, "synchronize")
    assert site_of([runner, warp, inside_torch, hook], "-", 0) == "context.py:7"
    sites = Counter({"warp_env.py:253": 2, "rollout.py:452": 1})
    assert host_syncs.sites_text(sites) == "warp_env.py:253 x2, rollout.py:452"
    assert host_syncs.sites_text(Counter()) == "none"


def test_warps_own_waits_are_counted_at_the_line_that_led_to_them():
    """Torch's sync debug mode never sees Warp's waits (the ones MuJoCo Warp's solver makes
    outside a captured graph): the GPU tests that a step never waits count them beside."""
    warp = pytest.importorskip("warp")
    host_syncs = load("host_syncs")

    def waits() -> None:
        warp.synchronize()
        warp.synchronize_device("cpu")

    first = waits.__code__.co_firstlineno + 1
    whole = warp.synchronize
    sites = Counter()
    with host_syncs.warp_waits_counted(sites):
        waits()
    assert sites == Counter(
        {f"test_benchmarks.py:{first}": 1, f"test_benchmarks.py:{first + 1}": 1}
    )
    assert warp.synchronize is whole  # (put back)


def test_a_step_profile_sums_kernels_per_step_and_ranks_the_costliest():
    """benchmarks/kernel_profile.py on hand-built launches: 2 steps, 3 kernel names."""
    kernel_profile = load("kernel_profile")
    ops = ["aten::mm", "aten::add", "aten::mm", "aten::add", "aten::copy_", "aten::tanh"]
    launches = [("gemm", 30.0), ("add", 2.0), ("gemm", 50.0), ("add", 4.0), ("copy", 10.0)]
    launches += [("Memcpy DtoD (Device -> Device)", 7.0), ("Memset (Device)", 1.0)]
    step = kernel_profile.summarise(ops, launches, steps=2, top=2)
    assert step.ops == 3.0
    assert step.kernels == 2.5
    assert step.copies == 1.0  # (not kernels: their time is not in kernel_ms)
    assert step.kernel_ms == pytest.approx(0.048)  # 96 us over 2 steps
    assert step.top == [
        ("gemm", pytest.approx(0.040), 1.0),  # 80 us / 2 steps, one launch a step
        ("copy", pytest.approx(0.005), 0.5),
    ]
    text = kernel_profile.profile_text("ours", step)
    assert text.splitlines()[0] == (
        "- ours: 3.0 torch operators, 2.5 kernels, 0.048 ms of kernels, 1.0 copies per step"
    )


def test_the_replay_of_ours_commands_gives_ours_physics_before_and_after_a_reset():
    """benchmarks/command_replay.py on Warp's CPU device (reach, 4 worlds, episodes of 5 steps):
    the simulator alone, given the collect phase's servo targets and its resets' states from its
    start, ends in the very state the collect phase ended in: after 4 steps (no episode ended)
    and after 8 (every episode ended at the fifth)."""
    pytest.importorskip("mujoco_warp")
    import torch

    from embodied.simulators.mujoco import MuJoCoConfig, make_env

    throughput = load("gpu_throughput")
    replay = throughput.command_replay
    env = make_env(MuJoCoConfig(task="reach", num_envs=4, backend="warp", max_episode_steps=5))
    ours = throughput.ours_loop(env)
    for steps, resets in [(4, []), (8, [4])]:
        recorded = replay.record(env, ours.prepare, ours.run, steps)
        assert recorded.targets.shape == (steps, 4, 6) and list(recorded.restores) == resets
        ours_end = replay.state(env)
        assert not torch.equal(ours_end["qpos"], recorded.start["qpos"])  # the arm moved
        replay.restore(env, recorded.start)
        replay.replay(env, recorded, steps)
        replayed_end = replay.state(env)
        for name, value in ours_end.items():
            assert torch.equal(replayed_end[name], value), name
    assert "_physics" not in vars(env)  # the recording's hooks are gone
    from embodied.simulators.mujoco.randomize import RandomizeConfig

    cfg = MuJoCoConfig(
        task="reach", num_envs=2, backend="warp", randomize=RandomizeConfig(servo_gain=0.1)
    )
    randomized = make_env(cfg)  # a reset writes model fields too, which no replay restores
    with pytest.raises(ValueError, match="randomize off"):
        replay.record(randomized, prepare=None, run=None, steps=1)  # (refused before either)


def test_the_throughput_row_has_a_cell_under_every_heading_a_failed_replay_included():
    """benchmarks/gpu_throughput.py's table on hand-built rates (world-steps/s)."""
    throughput = load("gpu_throughput")
    head = throughput.header(compiled=True, replay=True).splitlines()[0]
    measured = throughput.Measured(
        raw=1000.0,
        ours=900.0,
        compiled=950.0,
        replay=960.0,
        sites={},
        profile={},
        rates_per_round={"raw": [1000.0], "ours": [900.0], "compiled": [950.0], "replay": [960.0]},
    )
    syncs = {"ours": 0.1, "compiled": 0.0}
    row = throughput.cells(measured, syncs=syncs, compiled=True, replay=True)
    assert row == " 1,000 | 960 | 900 | 0.90 | 0.94 | 950 | 0.95 | 0.99 | 0.10 | 0.00 |"
    assert head.count("|") - 5 == row.count("|")  # (sim, device, obs, worlds come first)
    assert head.endswith("| host syncs per step | compiled host syncs per step |")
    rounds = {"raw": [1000.0], "ours": [900.0]}  # (the replay failed: no rounds)
    failed = throughput.Measured(1000.0, 900.0, None, None, {}, {}, rounds)
    assert throughput.cells(failed, {}, False, True) == " 1,000 | - | 900 | 0.90 | - | - |"
    plain = throughput.header(compiled=False, replay=False).splitlines()[0]
    assert plain.endswith(
        "| raw world-steps/s | ours world-steps/s | ours/raw | host syncs per step |"
    )


def test_a_ratio_is_the_median_of_its_rounds_ratios_with_their_range():
    """Three hand-built rounds in which the machine's speed drifted: the paired ratios are 0.90,
    0.98 and 0.96 (their median 0.96), where the medians' ratio would say 900 / 1000 = 0.90."""
    throughput = load("gpu_throughput")
    rounds = {"raw": [1000.0, 800.0, 1200.0], "ours": [900.0, 784.0, 1152.0]}
    measured = throughput.Measured(1000.0, 900.0, None, None, {}, {}, rounds)
    assert measured.per_round("ours", "raw") == pytest.approx([0.90, 0.98, 0.96])
    assert measured.ratio("ours", "raw") == pytest.approx(0.96)
    assert measured.per_round("replay", "raw") == []
    row = throughput.cells(measured, {}, compiled=False, replay=True)
    assert row == " 1,000 | - | 900 | 0.96 (0.90-0.98) | - | - |"


def test_the_loops_take_turns_in_each_round_and_a_failing_replay_drops_out():
    """gpu_throughput.interleaved on hand-built loops: the order they ran in, and what is kept."""
    import types

    throughput = load("gpu_throughput")
    env = types.SimpleNamespace(device=torch.device("cpu"), num_envs=4)
    ran = []

    def loop(label: str, fails: bool = False):
        def run(n: int) -> None:
            ran.append((label, n))
            if fails and ran.count((label, n)) == 2:  # its second run fails
                raise RuntimeError("no replay on this device")

        return throughput.Loop(prepare=lambda: ran.append((label, "prepare")), run=run)

    loops = {"raw": loop("raw"), "ours": loop("ours"), "replay": loop("replay", fails=True)}
    rates = throughput.interleaved(env, loops, steps=3, repeats=3)
    runs = [label for label, what in ran if what == 3]
    # the first turn passes on each round; the replay fails in round 2 and drops out
    assert runs == ["raw", "ours", "replay", "ours", "replay", "raw", "raw", "ours"]
    assert [label for label, what in ran if what == "prepare"] == runs  # each run prepared
    assert set(rates) == set(loops) == {"raw", "ours"}
    assert [len(v) for v in rates.values()] == [3, 3] and min(rates["raw"]) > 0
    ran.clear()
    loops = {"raw": loop("raw"), "ours": loop("ours"), "compiled": loop("compiled", fails=True)}
    assert set(throughput.interleaved(env, loops, steps=3, repeats=2)) == {"raw", "ours"}
    ran.clear()
    with pytest.raises(RuntimeError, match="no replay"):  # raw and ours may not fail quietly
        throughput.interleaved(env, {"raw": loop("raw", fails=True)}, steps=3, repeats=3)


def test_take_turns_passes_the_first_turn_on_and_reports_each_round():
    take_turns = load("turns").take_turns
    ran = []
    rounds = []

    def run(label: str):
        def once() -> int:
            ran.append(label)
            return len(ran)  # the run's place in the whole order

        return once

    runs = {label: run(label) for label in ("a", "b", "c")}
    results = take_turns(runs, 4, after_round=lambda i, r: rounds.append((i, len(r["a"]))))
    assert ["".join(ran[i : i + 3]) for i in range(0, 12, 3)] == ["abc", "bca", "cab", "abc"]
    assert results == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}
    assert rounds == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_take_turns_raises_a_failure_unless_told_where_to_drop_it():
    take_turns = load("turns").take_turns

    def fails() -> float:
        raise ValueError("broken loop")

    with pytest.raises(ValueError, match="broken loop"):
        take_turns({"ok": lambda: 1.0, "bad": fails}, 2)
    told = []
    results = take_turns({"bad": fails}, 3, dropped=lambda label, error: told.append(label))
    assert results == {} and told == ["bad"]  # (rounds with nothing left to run)


def test_an_update_is_timed_and_profiled_per_gradient_step():
    """benchmarks/update_profile.py on Warp's CPU device (push, 8 worlds x 4 steps, 2
    minibatches, 2 repeats): the milliseconds per gradient step follow from the repeats'
    seconds, and the profile saw the update's operators; host syncs are counted on CUDA only."""
    pytest.importorskip("mujoco_warp")
    import argparse
    import statistics

    bench = load("update_profile")
    args = argparse.Namespace(
        device="cpu", task="push", worlds=8, steps=4, minibatches=2, repeats=2
    )
    cfg, roles = bench.build(args)
    assert cfg.algorithm.target_kl is None  # (an early stop made fewer steps than it divides by)
    try:
        row = bench.measure(cfg, roles, repeats=2)
    finally:
        roles.close()
    steps = cfg.algorithm.update_epochs * 2
    assert row["samples"] == 32 and row["gradient_steps"] == steps
    assert len(row["update_s_per_repeat"]) == 2
    median_ms = 1000 * statistics.median(row["update_s_per_repeat"])
    assert row["ms_per_gradient_step"] == pytest.approx(median_ms / steps)
    assert row["profile"]["ops"] > 0 and row["profile"]["kernels"] == 0
    assert row["sync_sites"] is None
    assert f"{steps} gradient steps" in bench.report(row)


def test_the_gpu_suite_runs_every_test_file_that_holds_gpu_tests():
    """``benchmarks/gpu_suite.sh`` measures everything that needs a GPU in one command: a test
    file with a ``gpu`` mark that none of its stages names would never run."""
    tests = Path(__file__).parent
    gpu_mark = re.compile(r"(@|marks=|pytestmark = )pytest\.mark\.gpu\b")
    marked = {p.name for p in tests.glob("test_*.py") if gpu_mark.search(p.read_text())}
    assert len(marked) >= 6  # (the marks were found)
    suite = (tests.parent / "benchmarks" / "gpu_suite.sh").read_text()
    assert {name for name in marked if f"tests/{name}" not in suite} == set()
