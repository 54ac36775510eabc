"""How a config's values are read: a command-line value by the type of its setting, a YAML file
as YAML (without duplicate keys; its numbers by their settings' types), and the one-line errors
for values that do not fit."""

import dataclasses
import textwrap
from pathlib import Path

import pytest

from embodied.cli import main
from embodied.config import COMMAND_LINE, ConfigError, load_config, validate_tree
from embodied.train_config import TrainConfig

REACH = "configs/mujoco/reach_ppo.yaml"


def load(*overrides: str):
    return load_config(TrainConfig, REACH, list(overrides), files=False)[0]


@pytest.mark.parametrize(
    "text", ["no", "true", "on", "0755", "12:30", "0x1F", "1_000", "2024-01-01", "null", "1e3"]
)
def test_a_str_setting_takes_the_text_of_its_command_line_value(text):
    """YAML 1.1 read these as False, True, True, 493, 750, 31, 1000, a date (refused), None and
    a string: the run went to a directory the user had not named."""
    assert load(f"runner.name={text}").runner.name == text
    assert load(f"runner.init_from={text}").runner.init_from == (None if text == "null" else text)


def test_quotes_an_empty_value_and_lists_of_str_on_the_command_line():
    assert load("runner.name='no'").runner.name == "no"  # (quoted: YAML's string, as in a file)
    assert load("runner.init_from=").runner.init_from is None  # (an empty optional: None)
    with pytest.raises(ConfigError, match=r"^runner.name: a folder .* got ''"):
        load('runner.name=""')
    keys = load("policy.privileged_keys=[goal_pos, no, 0x1F]").policy.privileged_keys
    assert keys == ["goal_pos", "no", "0x1F"]
    cfg = load("runner.pipeline_stages=auto", "runner.deterministic=yes", "seed=0x10")
    assert (cfg.runner.pipeline_stages, cfg.runner.deterministic, cfg.seed) == ("auto", True, 16)


def test_an_int_setting_takes_a_whole_number_written_as_a_float():
    cfg = load("runner.total_env_steps=5e6", "runner.eval_episodes=1.5e1", "seed=3.0")
    assert (cfg.runner.total_env_steps, cfg.runner.eval_episodes, cfg.seed) == (5_000_000, 15, 3)
    for text in ("5.5", "5e-1", "1e30"):  # (not whole, or past 64 bits: named as a float)
        with pytest.raises(ConfigError, match=r"^runner.total_env_steps: .*'float'.*command line"):
            load(f"runner.total_env_steps={text}")
    with pytest.raises(ConfigError, match=r"^seed: .*'bool'"):  # (a bool is not a number)
        load("seed=true")
    # a list of ints item by item, as a file's (the command line refused 64.0)
    assert load("policy.hidden_sizes=[6.4e1,32]").policy.hidden_sizes == [64, 32]
    with pytest.raises(ConfigError, match=r"^policy.hidden_sizes\[0\]: .*'float'"):
        load("policy.hidden_sizes=[64.5,32]")


def test_a_files_numbers_in_exponent_form_are_read_by_their_settings_type(tmp_path):
    """PyYAML (YAML 1.1) reads ``3e-4`` and ``5e6``, with no dot, as text, which a float setting
    refused; a file's number is now read by its setting's type, as an override's is."""
    path = tmp_path / "exponents.yaml"
    head = f"defaults: [{Path(REACH).resolve()}]\n"
    text = """
        algorithm: {learning_rate: 3e-4}
        runner: {total_env_steps: 5e6, eval_episodes: 2.0e1, max_minutes: 1.5E+1, name: 1e3}
        env: {randomize: {friction: 5e-2}}
        policy: {hidden_sizes: [6.4e1, 32]}
    """
    path.write_text(head + textwrap.dedent(text).lstrip())
    cfg = load_config(TrainConfig, path, files=False)[0]
    assert cfg.algorithm.learning_rate == 3e-4 and cfg.env.randomize.friction == 0.05
    runner = cfg.runner
    assert (runner.total_env_steps, runner.eval_episodes, runner.max_minutes) == (5e6, 20, 15.0)
    assert type(runner.total_env_steps) is int and runner.name == "1e3"  # (a str stays text)
    assert cfg.policy.hidden_sizes == [64, 32]
    path.write_text(head + "runner: {total_env_steps: 5.5e0}\n")  # (not whole: named a float)
    with pytest.raises(ConfigError, match=r"^runner.total_env_steps: .*'float'.*exponents.yaml"):
        load_config(TrainConfig, path, files=False)


def test_a_leading_zero_is_decimal_and_dates_and_times_stay_text(tmp_path):
    """YAML 1.1 read ``010`` as octal 8 (a sweep's ``seed=010`` ran seed 8, as ``seed=008`` did),
    ``12:30`` as 750 and ``2024-05-01`` as a date, on the command line and in a file."""
    cfg = load("seed=010", "env.num_envs=016", "runner.eval_every=008")
    assert (cfg.seed, cfg.env.num_envs, cfg.runner.eval_every) == (10, 16, 8)
    assert load("seed=0o17").seed == 15 and load("seed=0x1F").seed == 31  # (YAML 1.2's forms)
    path = tmp_path / "padded.yaml"
    head = f"defaults: [{Path(REACH).resolve()}]\n"
    path.write_text(head + "seed: 011\nenv: {num_envs: 0032}\nrunner: {name: 2024-05-01}\n")
    cfg = load_config(TrainConfig, path, files=False)[0]
    assert (cfg.seed, cfg.env.num_envs, cfg.runner.name) == (11, 32, "2024-05-01")
    for name in ("12:30", "2024_05_01"):
        path.write_text(head + f"runner: {{name: {name}}}\n")
        assert load_config(TrainConfig, path, files=False)[0].runner.name == name


GRPO_VLA = "configs/maniskill/multitask_vla_grpo.yaml"


def test_a_choice_switched_on_the_command_line_keeps_the_settings_both_choices_have():
    """``algorithm.name=ppo`` over a GRPO file (the README's way to train the VLA with a critic)
    was refused: the file's group_size is no PPO key. The GRPO-only keys are left behind; the
    shared ones (learning_rate, update_epochs) keep the file's values."""
    from embodied.ppo import PPOConfig

    cfg = load_config(TrainConfig, GRPO_VLA, ["algorithm.name=ppo", "policy.value_head=true"])[0]
    assert isinstance(cfg.algorithm, PPOConfig)
    assert (cfg.algorithm.learning_rate, cfg.algorithm.update_epochs) == (2e-5, 2)
    assert cfg.algorithm.exploration_log_std == -1.5  # (GRPO's alone, it was dropped: std -1)


def test_a_null_word_sets_any_optional_setting_to_none_on_the_command_line(tmp_path):
    """``policy.privileged_keys=null`` (all of the environment's) was an OmegaConf error: only a
    str setting took the null words."""
    path = tmp_path / "goal.yaml"
    path.write_text(f"defaults: [{Path(REACH).resolve()}]\npolicy: {{privileged_keys: [goal]}}\n")
    for word in ("null", "~", "Null"):
        cfg = load_config(TrainConfig, path, [f"policy.privileged_keys={word}"], files=False)[0]
        assert cfg.policy.privileged_keys is None
    assert load("policy.privileged_keys=[goal]").policy.privileged_keys == ["goal"]


@pytest.mark.parametrize(
    "overrides, field, kind",
    [
        (
            ["algorithm={name: ppo, learning_rate: 1e-4}", "policy.value_head=true"],
            "algorithm",
            "PPOConfig",
        ),
        (["policy={name: actor_critic, hidden_sizes: [64]}"], "policy", "ActorCriticConfig"),
        (
            ["env={simulator: mujoco, task: pick, obs_mode: rgb, backend: rollout}"],
            "env",
            "MuJoCoConfig",
        ),
    ],
)
def test_a_section_given_whole_on_the_command_line_chooses_its_schema(overrides, field, kind):
    """A section given whole is read as in a file, its choice key included: ``algorithm={name:
    ppo}`` gave a GRPOConfig named "ppo" (the run trained GRPO, and its saved config could not
    be read back), ``env={simulator: mujoco}`` a ManiSkillConfig."""
    cfg = load_config(TrainConfig, GRPO_VLA, overrides, files=False)[0]
    assert type(getattr(cfg, field)).__name__ == kind


def test_one_item_of_a_list_is_refused_in_one_line(tmp_path, capsys):
    """``policy.hidden_sizes.0=64`` was a TypeError from OmegaConf's merge, with a traceback."""
    with pytest.raises(ConfigError) as err:
        load("policy.hidden_sizes.0=64")
    assert str(err.value) == (
        "policy.hidden_sizes: a list is set whole, as in policy.hidden_sizes=[256,256], "
        "not by item (in the command line)"
    )
    assert main(["train", REACH, "policy.hidden_sizes.0=64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "policy.hidden_sizes" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: {hidden_sizes: {a: 64}}\n")
    with pytest.raises(
        ConfigError, match=r"^policy.hidden_sizes: a list was given a mapping .*bad"
    ):
        load_config(TrainConfig, bad, files=False)
    with pytest.raises(ConfigError, match=r"^runner: a mapping of keys, got a list \(in the com"):
        load("runner=[1]")


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


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.env.resources={a: .nan}", "cluster.env.resources.a: not a number, got nan"),
        ("cluster.actor.resources.GPU_x=.inf", "cluster.actor.resources.GPU_x: must be finite"),
        ("cluster.eval.resources={b: -.inf}", "cluster.eval.resources.b: must be finite"),
    ],
)
def test_non_finite_numbers_in_a_dict_setting_are_refused(override, message):
    """``_check_numbers`` looked at plain float fields only; ``nan < 0`` let NaN through."""
    with pytest.raises(ConfigError) as err:
        load(override)
    assert str(err.value).startswith(message) and str(err.value).endswith("(in the command line)")
    cfg = load("cluster.enabled=true", "cluster.env.resources={a: 0.5}")
    assert cfg.cluster.env.resources == {"a": 0.5}


@dataclasses.dataclass
class Pair:
    width: int = 4
    heads: int = 2

    def validate(self):
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")


@dataclasses.dataclass
class Holder:
    pair: Pair = dataclasses.field(default_factory=Pair)


def test_a_check_that_names_no_key_first_is_said_once_with_where_its_fields_were_set():
    """Such a message was repeated and blamed the file: ``policy.d_model (256) must be ...:
    d_model (256) must be ... (in multitask_vla_sft.yaml)`` for ``policy.heads=3``."""
    cases = [
        ([("a.yaml", {"seed": 1}), (COMMAND_LINE, {"pair": {"heads": 3}})], ""),
        ([("a.yaml", {"pair": {"width": 5}}), (COMMAND_LINE, {"seed": 1})], "a.yaml"),
        ([("a.yaml", {"pair": {"width": 5}}), ("b.yaml", {"pair": {"heads": 3}})], "both"),
    ]
    for sources, where in cases:
        pair = Pair(**{k: v for _, d in sources for k, v in d.get("pair", {}).items()})
        with pytest.raises(ConfigError) as err:
            validate_tree(Holder(pair), "", sources)
        why = f"pair: width ({pair.width}) must be divisible by heads ({pair.heads})"
        expected = {
            "": f"{why} (in the command line)",
            "a.yaml": f"{why} (in a.yaml)",
            "both": f"{why} (pair.width in a.yaml, pair.heads in b.yaml)",
        }[where]
        assert str(err.value) == expected


def test_the_vla_heads_error_names_the_command_line_once(capsys):
    argv = ["sft", "configs/maniskill/multitask_vla_sft.yaml", "policy.heads=3"]
    assert main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.endswith("(in the command line)"), line
    assert line.count("must be") == 1 and ".yaml" not in line, line


def test_yes_no_on_off_are_text_for_a_text_setting_and_booleans_for_a_flag(tmp_path):
    """PyYAML reads YAML 1.1, where ``no`` is False: ``runner: {name: no}`` in a file, or
    ``runner={name: no}`` on the command line, named the run "False"."""
    path = tmp_path / "named.yaml"
    path.write_text("runner: {name: no, video: off}\n")
    cfg = load_config(TrainConfig, path, files=False)[0]
    assert (cfg.runner.name, cfg.runner.video) == ("no", False)
    overrides = ["runner={name: off, video: yes, progress: no}"]
    cfg = load_config(TrainConfig, path, overrides, files=False)[0]
    assert (cfg.runner.name, cfg.runner.video, cfg.runner.progress) == ("off", True, False)


def test_cluster_settings_that_a_run_in_one_process_ignores_are_said():
    """A cluster line copied without ``cluster.enabled=true`` trained in one process, its saved
    config saying two actor workers; a note, not an error (a cluster config run with
    ``cluster.enabled=false``, for a replay or on one machine, is meant)."""
    from embodied.cluster.config import ignored_in_one_process

    cluster = load(
        "cluster.actor.workers=2", "cluster.placement=disaggregated", "cluster.offload_optimizer=1"
    ).cluster
    assert ignored_in_one_process(cluster) == (
        "note: cluster.placement, cluster.actor.workers apply to the roles on Ray; "
        "cluster.enabled is false, so this run, in one process, ignores them"
    )
    assert ignored_in_one_process(load("cluster.offload_optimizer=true").cluster) is None
    on_ray = load("cluster.enabled=true", "cluster.actor.workers=2").cluster
    assert ignored_in_one_process(on_ray) is None


def test_naming_the_default_choice_keeps_the_schemas_own_default():
    """``env.simulator: maniskill`` (already SFT's and demos' simulator) replaced their default
    section by ManiSkill's class defaults: obs_mode state, and a refusal of a key never set."""
    from embodied.config import compose
    from embodied.demos import DemosConfig
    from embodied.sft_config import SFTConfig

    named = {"simulator": "maniskill", "task": "PushCube-v1"}
    sft = compose(SFTConfig, [("a.yaml", {"datasets": ["d"], "env": named})])
    assert sft.env.obs_mode == "rgb"
    assert compose(DemosConfig, [("b.yaml", {"env": named})]).env.obs_mode == "rgb+state"
    # another choice, or the same one on a schema whose default is another kind, as before
    mujoco = compose(SFTConfig, [("a.yaml", {"datasets": ["d"], "env": {"simulator": "mujoco"}})])
    assert type(mujoco.env).__name__ == "MuJoCoConfig"
    assert compose(TrainConfig, [("c.yaml", {"env": named})]).env.obs_mode == "state"


def test_what_omegaconf_would_take_silently_is_refused(tmp_path):
    """``runner.name=???`` (OmegaConf's mark of a value not set) left the file's name in place
    without a word; ``runner.progress=2`` was true. A file's alike."""
    with pytest.raises(ConfigError, match=r"^runner.name: \?\?\? marks a value not set; give one"):
        load("runner.name=???")
    for text in ("2", "-1", "0.5", "1.0"):
        with pytest.raises(ConfigError, match=f"^runner.progress: true or false, got {text} "):
            load(f"runner.progress={text}")
    assert load("runner.progress=no").runner.progress is False  # (a bool's words stay)
    assert load("runner.progress=0").runner.progress is False  # (and 0 and 1)
    path = tmp_path / "bool.yaml"
    path.write_text(f"defaults: [{Path(REACH).resolve()}]\nrunner: {{video: 3}}\n")
    with pytest.raises(ConfigError, match=r"^runner.video: true or false, got 3 \(in .*bool"):
        load_config(TrainConfig, path, files=False)
