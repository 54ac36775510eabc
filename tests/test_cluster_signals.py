"""A SIGTERM to every process of a cluster run, as SLURM's ``scancel`` and time limit, ``timeout``
or systemd send it: the run's own Ray holds the signal in its daemons and workers, so the driver
alone stops, saves the last completed iteration through the actor worker and exits 143, as an
embedded run does (embodied/cluster/start.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_runs import TINY_REACH

from embodied.checkpoint import load_checkpoint

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


def session_of(leader: int) -> list[int]:
    """Every process in the session ``leader`` started (ours: the driver, Ray's daemons and
    the workers they started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        if entry.name.isdigit() and int(fields[3]) == leader:
            pids.append(int(entry.name))
    return pids


def training_rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum("policy/loss" in json.loads(line) for line in lines if line.endswith("}"))


@pytest.mark.slow  # (about 20 s: a run through the command line, on a Ray of its own)
def test_sigterm_to_every_process_of_a_cluster_run_saves_its_last_iteration(tmp_path):
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "embodied.cli",
        "train",
        str(ROOT / "configs/mujoco/reach_ppo.yaml"),
    ]
    argv += [*TINY_REACH, "runner.total_env_steps=1000000", "runner.save_every=0"]
    argv += ["cluster.enabled=true", f"runner.output_dir={tmp_path}", "runner.name=run"]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    driver = subprocess.Popen(
        argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        while training_rows(run) < 2:  # (two iterations done; save_every 0: none saved)
            assert driver.poll() is None, driver.communicate()
            time.sleep(0.5)
        processes = session_of(driver.pid)
        assert len(processes) > 3  # the driver, Ray's GCS and raylet, the workers
        for pid in processes:
            os.kill(pid, signal.SIGTERM)
        _, err = driver.communicate()
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 128 + signal.SIGTERM, err.decode()[-3000:]
    saved = load_checkpoint(run)["counters"]["iteration"]
    assert saved >= 2
    assert f"stopped after iteration {saved}; checkpoint: {run / 'last'}" in err.decode()
    while session_of(driver.pid):  # Ray stopped with the run: nothing of it stays
        time.sleep(0.5)
