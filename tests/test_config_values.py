"""How a config's values are read: a command-line value by the type of its setting, a YAML file
as YAML (without duplicate keys), and the one-line errors for values that do not fit."""

import textwrap
from pathlib import Path

import pytest

from embodied.config import ConfigError, load_config
from embodied.train_config import TrainConfig

REACH = "configs/mujoco/reach_ppo.yaml"


def load(*overrides: str):
    return load_config(TrainConfig, REACH, list(overrides), files=False)[0]


def test_a_key_given_twice_in_a_yaml_file_is_refused_with_its_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second ``runner:`` block dropped the first."""
    text = """
        runner:
          name: dup_run
          total_env_steps: 5000
        env: {num_envs: 4}
        runner:
          eval_every: 5
    """
    path = tmp_path / "dup.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, path, files=False)
    assert (
        str(err.value) == f"{path} line 5: invalid YAML (duplicate key 'runner', first at line 1)"
    )
    path.write_text("seed: 1\nrunner:\n  name: a\n  env: {num_envs: 4, num_envs: 8}\n")
    with pytest.raises(ConfigError) as err:  # (at any level)
        load_config(TrainConfig, path, files=False)
    assert (
        str(err.value) == f"{path} line 4: invalid YAML (duplicate key 'num_envs', first at line 4)"
    )
    merged = "runner: {<<: {name: a, total_env_steps: 5000}, name: b}\n"  # (a merge key: no dup)
    path.write_text(f"defaults: [{Path(REACH).resolve()}]\n{merged}")
    cfg = load_config(TrainConfig, path, files=False)[0]
    assert (cfg.runner.name, cfg.runner.total_env_steps) == ("b", 5000)
