"""Every shipped config and every `embodied ...` line of the README pass the checks their command
runs before it builds anything (``cli.check_config``: keys, values, the sections against each
other, the tasks the simulators know), with the files and devices they name checked for form
only: neither the configs nor the README can drift from the code unnoticed."""

import re
import shlex
from pathlib import Path

import pytest

from embodied.cli import check_config, parse

ROOT = Path(__file__).resolve().parent.parent
FRAGMENTS = ["configs/maniskill/base.yaml"]  # only ever listed under other configs' `defaults:`


def readme_commands() -> list[list[str]]:
    """The argv of each `embodied ...` line of the README's bash blocks (continued lines joined,
    comments dropped)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["embodied"]:
                lines.append(words[1:])
    return lines


def whole_configs() -> list[str]:
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml"))
    return [path for path in found if path not in FRAGMENTS]


def command_of(path: str) -> str:
    """The command a shipped config is for, by its folder and name."""
    name = Path(path).stem
    if path.startswith("configs/bench/"):
        return "bench"
    if name.startswith("demos_"):
        return "demos"
    return "sft" if "_sft" in name else "train"


def readme_argv(path: str) -> list[str] | None:
    """The README's first command line for the config at ``path``, if it has one."""
    return next((argv for argv in readme_commands() if path in argv), None)


def test_the_readme_has_command_lines_and_fragments_are_only_defaults():
    assert len(readme_commands()) >= 20  # the parser below sees the README's blocks
    listed = [
        entry
        for path in whole_configs()
        for line in (ROOT / path).read_text().splitlines()
        if line.startswith("defaults:")
        for entry in re.findall(r"[\w./-]+\.yaml", line)
    ]
    assert all(Path(fragment).name in listed for fragment in FRAGMENTS)


@pytest.mark.parametrize("path", whole_configs())
def test_every_shipped_config_passes_its_commands_checks(path, monkeypatch):
    """The config as shipped, with the overrides the README gives it where it needs some (a local
    model directory), and the README runs it with the command it is for."""
    monkeypatch.chdir(ROOT)
    argv = readme_argv(path) or [command_of(path), path]
    assert argv[0] == command_of(path)
    args = parse(argv)
    check_config(args, files=False)


@pytest.mark.parametrize("argv", readme_commands(), ids=" ".join)
def test_every_readme_command_line_parses_and_its_config_passes_its_checks(argv, monkeypatch):
    monkeypatch.chdir(ROOT)
    if argv == ["--help"]:
        with pytest.raises(SystemExit) as done:
            parse(argv)
        assert done.value.code == 0
        return
    args = parse(argv)
    if hasattr(args, "config"):
        check_config(args, files=False)


def test_a_missing_model_directory_is_a_files_check_only(tmp_path, monkeypatch):
    """`files=False` skips exactly the existence of named files; the form is still checked."""
    from embodied.config import ConfigError

    monkeypatch.chdir(ROOT)
    yaml = "configs/maniskill/multitask_smolvla_sft.yaml"
    absent = parse(["sft", yaml, f"policy.vlm_path={tmp_path / 'absent'}"])
    check_config(absent, files=False)
    with pytest.raises(ConfigError, match="policy.vlm_path: .*absent is not a model directory"):
        check_config(absent)
    with pytest.raises(ConfigError, match="policy.vlm_path: SmolVLA needs a local SmolVLM2"):
        check_config(parse(["sft", yaml]), files=False)


def test_a_config_that_trains_on_pickcube_reads_its_goal(monkeypatch):
    """PickCube hides its goal (a point in the air) from the cameras: a policy that does not read
    goal_pos cannot know where to lift (pickcube_rgb_ppo.yaml's read no privileged state)."""
    from embodied.config import load_config
    from embodied.schema import ActionSpec, EnvSpec, ObsSpec
    from embodied.sft_config import SFTConfig
    from embodied.train_config import TrainConfig

    monkeypatch.chdir(ROOT)
    privileged = {"goal_pos": (3,), "is_grasped": (1,)}  # (what PickCube gives beside cameras)
    action = ActionSpec(space="joint_delta", names=("j",), low=(-1.0,), high=(1.0,))
    spec = EnvSpec(ObsSpec(privileged=privileged), action, max_episode_steps=10)
    checked = []
    for path in whole_configs():
        if command_of(path) not in ("train", "sft"):
            continue
        schema = TrainConfig if command_of(path) == "train" else SFTConfig
        cfg, _ = load_config(
            schema, path, readme_argv(path)[2:] if readme_argv(path) else [], files=False
        )
        tasks = [getattr(cfg.env, "task", None), *(getattr(cfg.env, "tasks", None) or [])]
        if "PickCube-v1" in tasks:
            checked.append(path)
            assert "goal_pos" in cfg.policy.read_privileged(spec), path
    assert "configs/maniskill/pickcube_rgb_ppo.yaml" in checked and len(checked) >= 4
