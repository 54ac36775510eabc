"""Every cluster command of the README, run as a user types it on this machine (issue 33 item 5).

Each README block that holds a cluster command runs in a directory of its own, commands in
their order, with ``configs/`` beside them. Only the budget and the episode counts are added
(``runner.total_env_steps``, ``runner.*eval_episodes``); the ``init_from`` checkpoint a command
names is made here, an untrained policy for the config's tasks. A block that joins a running
cluster (``cluster.address=auto``) gets one of its own first.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBODIED = str(Path(sys.executable).parent / "embodied")
TINY = ["runner.total_env_steps=1", "runner.eval_episodes=1", "runner.final_eval_episodes=1"]


def readme_blocks() -> list[list[list[str]]]:
    """The README's bash blocks that hold a cluster command: their cluster commands, each as
    its words (continuation lines joined, comments dropped)."""
    text = (ROOT / "README.md").read_text()
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines = body.replace("\\\n", " ").splitlines()
        commands = [shlex.split(line, comments=True) for line in lines]
        cluster = [
            words
            for words in commands
            if words[:1] == ["embodied"] and any(w.startswith("cluster") for w in words[1:])
        ]
        if cluster:
            blocks.append(cluster)
    return blocks


BLOCKS = readme_blocks()


def test_the_readme_has_the_cluster_commands_this_file_runs():
    firsts = [" ".join(block[0][:3]) for block in BLOCKS]
    assert firsts == [
        "embodied train configs/maniskill/pushcube_ppo.yaml",
        "embodied train configs/maniskill/multitask_vla_grpo.yaml",
    ]
    assert [len(block) for block in BLOCKS] == [3, 1]  # (the second: megatron's TP ranks)


def untrained_checkpoint(config: Path, run_dir: Path) -> None:
    """``run_dir/last``: an untrained policy for ``config``'s tasks, as an SFT run's would be."""
    import torch

    from embodied.checkpoint import save_checkpoint
    from embodied.config import load_config
    from embodied.models import build_policy
    from embodied.multitask import make_env
    from embodied.train_config import TrainConfig, run_meta

    cfg = load_config(TrainConfig, config, ["runner.init_from=null"])[0]
    env = make_env(cfg.env)
    spec = env.spec
    env.close()
    torch.manual_seed(0)
    policy = build_policy(spec, cfg.policy)
    counters = {"iteration": 1, "env_steps": 0, "train_seconds": 0.0}
    save_checkpoint(
        run_dir, 1, model=policy, optimizer=None, counters=counters, meta=run_meta(cfg, spec)
    )


def run_block(block: list[list[str]], where: Path) -> list[str]:
    """The block's commands in ``where`` (its own cluster if a command joins one); their
    outputs, each command's exit checked."""
    where.mkdir()
    (where / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    head = None
    if any("cluster.address=auto" in words for words in block):
        from ray.cluster_utils import Cluster

        # a running cluster of this test's own, as `ray start --head` makes one (the machine's
        # CPUs); its address in RAY_ADDRESS, so the command joins it and no other test's
        head = Cluster(initialize_head=True)
    outputs = []
    try:
        for words in block:
            init_from = [w.split("=", 1)[1] for w in words if w.startswith("runner.init_from=")]
            config = where / words[2] if words[1] == "train" else None
            if config is not None:
                text = config.read_text()
                named = re.search(r"init_from: (\S+)", text)
                for path in init_from or ([named.group(1)] if named else []):
                    if path != "null" and not (where / path).exists():
                        untrained_checkpoint(config, where / Path(path).parent)
            argv = [EMBODIED, *words[1:], *(TINY if words[1] == "train" else [])]
            joins = {"RAY_ADDRESS": head.address} if "cluster.address=auto" in words else {}
            done = subprocess.run(
                argv, env={**env, **joins}, cwd=where, capture_output=True, text=True
            )
            assert done.returncode == 0, (words, done.stdout[-3000:], done.stderr[-3000:])
            outputs.append(done.stdout)
    finally:
        if head is not None:
            head.shutdown()
    return outputs


@pytest.mark.slow  # (91 s on 2 cores; CI runs the slow set)
def test_the_first_cluster_command_fits_this_machine(tmp_path):
    """``cluster.enabled=true`` with the roles' default requests: a local Ray started by the run
    sizes them to the machine's CPUs (on 2 cores: 2/3 CPU each for env, rollout and actor)."""
    block = [BLOCKS[0][0]]
    (output,) = run_block(block, tmp_path / "pushcube")
    assert "final evaluation: success" in output
    status = (tmp_path / "pushcube" / "runs" / "pushcube_ppo" / "cluster.json").read_text()
    assert '"role": "rollout"' in status and '"role": "actor"' in status


@pytest.mark.slow  # (several minutes: two VLA runs on ManiSkill's cameras)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_readme_cluster_command_runs_here(index, tmp_path):
    outputs = run_block(BLOCKS[index], tmp_path / f"block{index}")
    trains = [out for words, out in zip(BLOCKS[index], outputs) if words[1] == "train"]
    assert all("final evaluation: success" in out for out in trains)
