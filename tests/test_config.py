"""Config loading: defaults lists, overrides, and one-line errors naming the key path and file."""

import textwrap

import pytest
import torch

from embodied.cli import main
from embodied.config import ConfigError, load_config
from embodied.train_config import TrainConfig


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_list_and_overrides_compose(tmp_path):
    write(
        tmp_path,
        "base.yaml",
        """
        env: {task: PickCube-v1, num_envs: 4}
        algorithm: {gamma: 0.9}
    """,
    )
    cfg_file = write(
        tmp_path,
        "exp.yaml",
        """
        defaults: [base.yaml]
        env: {num_envs: 6}
    """,
    )
    cfg, sources = load_config(
        TrainConfig, cfg_file, ["algorithm.gamma=0.5", "policy.hidden_sizes=[32,32]"]
    )
    assert cfg.env.task == "PickCube-v1"  # from the default
    assert cfg.env.num_envs == 6  # the file overrides its default
    assert cfg.algorithm.gamma == 0.5 and cfg.policy.hidden_sizes == [32, 32]  # command line wins
    assert cfg.algorithm.learning_rate == TrainConfig().algorithm.learning_rate  # schema default
    assert [s for s, _ in sources] == [
        str(tmp_path / "base.yaml"),
        str(cfg_file),
        "the command line",
    ]


def test_a_path_that_starts_with_the_home_directory_is_expanded(tmp_path, monkeypatch):
    """``runner.output_dir=~/runs`` reaches the program as typed (the shell expands a ~ after the
    = of a variable assignment only); it used to make a folder named ~ where the run started."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg_file = write(tmp_path, "exp.yaml", "runner: {init_from: ~/ckpt, name: ~x}\n")
    overrides = ["runner.output_dir=~/runs", "runner.resume=~/runs/a/last"]
    cfg, _ = load_config(TrainConfig, cfg_file, overrides, files=False)
    home = tmp_path / "home"
    assert cfg.runner.output_dir == f"{home}/runs" and cfg.runner.init_from == f"{home}/ckpt"
    assert cfg.runner.resume == f"{home}/runs/a/last"
    assert cfg.runner.name == "~x"  # (only ~/ is the home directory)
    from embodied.config import parse_overrides  # (what eval's env.* overrides go through)

    assert parse_overrides(["env.asset_dir=~/assets"]) == {"env": {"asset_dir": f"{home}/assets"}}


@pytest.mark.parametrize(
    "text, overrides, key, source",
    [
        ("env: {num_envz: 4}", [], "env.num_envz", "exp.yaml"),
        ("env: {num_envs: many}", [], "env.num_envs", "exp.yaml"),
        (
            "algorithm: {gamma: 0.9}",
            ["algorithm.clip_coeff=0.1"],
            "algorithm.clip_coeff",
            "the command line",
        ),
        ("env: {backend: tpu}", [], "env.backend", "exp.yaml"),
        ("runner: {total_env_steps: 0}", [], "runner.total_env_steps", "exp.yaml"),
        ("trainer: {recompute: true}", [], "trainer.recompute", "exp.yaml"),
        ("trainer: {precision: bf16}", [], "trainer.precision", "exp.yaml"),
        ("seed: 1", ["trainer.precision=fp16"], "trainer.precision", "command line"),
        (
            "algorithm: {name: grpo}",
            ["algorithm.behaviour_weight_cap=1.0"],
            "algorithm.behaviour_weight_cap",
            "command line",
        ),
    ],
)
def test_bad_keys_and_values_name_key_and_file(tmp_path, text, overrides, key, source):
    cfg_file = write(tmp_path, "exp.yaml", text)
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, cfg_file, overrides)
    msg = str(err.value)
    assert key in msg and source in msg and "\n" not in msg


def test_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(TrainConfig, tmp_path / "nope.yaml")
    cfg_file = write(tmp_path, "exp.yaml", "defaults: [missing_base.yaml]\n")
    with pytest.raises(
        ConfigError, match=r"missing_base.yaml \(listed in defaults of .*exp.yaml\)"
    ):
        load_config(TrainConfig, cfg_file)


def test_malformed_override_and_yaml(tmp_path):
    cfg_file = write(tmp_path, "exp.yaml", "seed: 1\n")
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        load_config(TrainConfig, cfg_file, ["seed"])
    bad = write(tmp_path, "bad.yaml", "env: {task: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml line .*invalid YAML"):
        load_config(TrainConfig, bad)


def test_cli_config_error_exits_2_with_one_line_and_no_traceback(tmp_path, capsys):
    cfg_file = write(tmp_path, "exp.yaml", "env: {num_envz: 4}\n")
    assert main(["train", str(cfg_file)]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "env.num_envz" in err
        and "exp.yaml" in err
        and "Traceback" not in err
    )


def test_shipped_vla_configs_load_and_smolvla_asks_for_its_model(tmp_path, capsys):
    from embodied.models import SmolVLAConfig, VLAConfig
    from embodied.sft import SFTConfig

    for name, schema in (
        ("multitask_vla_sft", SFTConfig),
        ("multitask_vla_sft_fewshot", SFTConfig),
        ("multitask_vla_grpo", TrainConfig),
        ("multitask_vla_grpo_fewshot", TrainConfig),
    ):
        assert isinstance(
            load_config(schema, f"configs/maniskill/{name}.yaml")[0].policy, VLAConfig
        )
    model = tmp_path / "smolvlm"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for name, schema in (
        ("multitask_smolvla_sft", SFTConfig),
        ("multitask_smolvla_grpo", TrainConfig),
    ):
        cfg, _ = load_config(schema, f"configs/maniskill/{name}.yaml", [f"policy.vlm_path={model}"])
        assert isinstance(cfg.policy, SmolVLAConfig) and cfg.policy.vlm_path == str(model)
        with pytest.raises(
            ConfigError,
            match=rf"^policy.vlm_path: SmolVLA needs a local SmolVLM2 directory .*{name}.yaml\)$",
        ):
            load_config(schema, f"configs/maniskill/{name}.yaml")
    assert (
        main(
            ["sft", "configs/maniskill/multitask_smolvla_sft.yaml", "policy.vlm_path=/nonexistent"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "policy.vlm_path: /nonexistent is not a model directory" in err


def test_policy_name_selects_the_policy_schema(tmp_path):
    from embodied.models import ActorCriticConfig, VLAConfig

    cfg_file = write(
        tmp_path,
        "vla.yaml",
        """
        env: {obs_mode: rgb}
        policy: {name: vla, head: flow, chunk_size: 8}
    """,
    )
    cfg, _ = load_config(TrainConfig, cfg_file, ["policy.d_model=128"])
    assert (
        isinstance(cfg.policy, VLAConfig)
        and cfg.policy.head == "flow"
        and cfg.policy.chunk_size == 8
    )
    assert cfg.policy.d_model == 128
    assert isinstance(
        load_config(TrainConfig, write(tmp_path, "ac.yaml", "seed: 1"))[0].policy, ActorCriticConfig
    )
    # the command line can switch the policy: the file's vla-only keys (head) are left behind,
    # the keys both have (chunk_size) kept; a key neither has is still refused
    switched = load_config(TrainConfig, cfg_file, ["policy.name=actor_critic"])[0].policy
    assert isinstance(switched, ActorCriticConfig) and switched.chunk_size == 8
    typo = write(tmp_path, "typo.yaml", "env: {obs_mode: rgb}\npolicy: {name: vla, haed: flow}")
    with pytest.raises(ConfigError, match=r"^policy.haed: unknown key .*\(in .*typo.yaml\)$"):
        load_config(TrainConfig, typo, ["policy.name=actor_critic"])
    with pytest.raises(
        ConfigError,
        match=r"policy.name: unknown policy 'transformer'; "
        r"known: \['actor_critic', 'smolvla', 'vla'\]",
    ):
        load_config(TrainConfig, cfg_file, ["policy.name=transformer"])
    with pytest.raises(ConfigError, match=r"policy.head: must be one of"):
        load_config(TrainConfig, cfg_file, ["policy.head=diffusion"])


def test_megatron_takes_a_vla_on_a_qwen2_5_vl_whose_language_model_splits(tmp_path):
    """`embodied train|sft CONFIG policy.vlm_path=DIR trainer.backend=megatron
    trainer.tensor_parallel=2` validates (it once refused every VLM); a TP size its language
    model's key-value groups do not split over is one error naming the key. The discrete head's
    bins must split as well."""
    from transformers import Qwen2_5_VLConfig

    from embodied.sft import SFTConfig

    text = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    text.update(vocab_size=64, intermediate_size=96)
    Qwen2_5_VLConfig(text_config=text).save_pretrained(tmp_path)
    megatron = [f"policy.vlm_path={tmp_path}", "trainer.backend=megatron"]
    for name, schema in (("multitask_vla_grpo", TrainConfig), ("multitask_vla_sft", SFTConfig)):
        path = f"configs/maniskill/{name}.yaml"
        cfg, _ = load_config(schema, path, [*megatron, "trainer.tensor_parallel=2"])
        assert cfg.trainer.tensor_parallel == 2 and cfg.policy.vlm_path == str(tmp_path)
        with pytest.raises(ConfigError, match=r"^trainer.tensor_parallel: .* 2 key-value groups"):
            load_config(schema, path, [*megatron, "trainer.tensor_parallel=4"])
    # a vocabulary, or an MLP, that does not split; a config.json that does not load
    path = "configs/maniskill/multitask_vla_grpo.yaml"
    for key, size in (("vocab_size", 66), ("intermediate_size", 98)):
        Qwen2_5_VLConfig(text_config={**text, key: size}).save_pretrained(tmp_path / key)
        overrides = [f"policy.vlm_path={tmp_path / key}", "trainer.backend=megatron"]
        with pytest.raises(ConfigError, match=rf"^trainer.tensor_parallel: .*\b{size}\b"):
            load_config(TrainConfig, path, [*overrides, "trainer.tensor_parallel=4"])
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    overrides = [f"policy.vlm_path={tmp_path / 'broken'}", "trainer.backend=megatron"]
    with pytest.raises(ConfigError, match=r"^policy.vlm_path: .*config.json does not load"):
        load_config(TrainConfig, path, overrides)
    with pytest.raises(ConfigError, match=r"^trainer.tensor_parallel: .* 100 bins .* 3 ranks"):
        load_config(
            TrainConfig,
            path,
            ["trainer.backend=megatron", "trainer.tensor_parallel=3"]
            + ["policy.heads=3", "policy.d_model=96", "policy.head=discrete", "policy.bins=100"]
            + ["algorithm.exploration_log_std=null"],  # (the discrete head has no log std)
        )


def test_resume_compares_only_the_keys_the_checkpoint_has(tmp_path):
    """A key newer than the checkpoint (its config lacks it) takes its default on resume; a key
    both have that changes the run's numbers is refused."""
    from embodied.resume import check_resume

    saved = {"algorithm": {"gamma": 0.8}}
    check_resume(saved, {"algorithm": {"gamma": 0.8, "behaviour_weight_cap": 5.0}}, tmp_path, False)
    with pytest.raises(ConfigError, match="algorithm.gamma is 0.5 here but 0.8"):
        check_resume(
            saved, {"algorithm": {"gamma": 0.5, "behaviour_weight_cap": 5.0}}, tmp_path, False
        )


def test_resume_may_change_what_the_run_records_and_reports_but_not_its_threads(tmp_path):
    """Rollout records, their pruning, the spike bound and the report change no number of the
    run (a record reads the random streams, it draws nothing); the thread count does (MKL and
    torch split their sums by thread)."""
    from embodied.resume import check_resume

    keys = ("record_rollouts", "keep_rollouts", "spike_factor", "report", "torch_threads")
    saved = {"runner": dict(zip(keys, (0, 5, 10.0, True, 1)))}
    check_resume(
        saved, {"runner": dict(zip(keys, (1, 2, float("inf"), False, 1)))}, tmp_path, False
    )
    with pytest.raises(ConfigError, match="runner.torch_threads is 2 here but 1"):
        check_resume(saved, {"runner": dict(zip(keys, (0, 5, 10.0, True, 2)))}, tmp_path, False)


def test_resume_refuses_another_precision_unless_forced(tmp_path):
    """trainer.* may change on resume (the backend, the TP size: the same numbers), but not
    trainer.precision: bf16 is not float32's rounding."""
    from embodied.resume import check_resume

    saved = {"trainer": {"backend": "torch", "precision": "fp32", "tensor_parallel": 1}}
    moved = {"trainer": {"backend": "megatron", "precision": "fp32", "tensor_parallel": 2}}
    check_resume(saved, moved, tmp_path, False)
    bf16 = {"trainer": {**moved["trainer"], "precision": "bf16"}}
    with pytest.raises(ConfigError, match="trainer.precision is 'bf16' here but 'fp32'"):
        check_resume(saved, bf16, tmp_path, False)
    check_resume(saved, bf16, tmp_path, True)
    # the torch backend trains in float32 whatever it says: auto and fp32 are one run there
    auto = {"trainer": {"backend": "torch", "precision": "auto", "tensor_parallel": 1}}
    check_resume(auto, saved, tmp_path, False)
    check_resume(auto, moved, tmp_path, False)
    with pytest.raises(ConfigError, match="trainer.precision is 'bf16' here but 'fp32'"):
        check_resume(auto, bf16, tmp_path, False)
    megatron_auto = {"trainer": {**moved["trainer"], "precision": "auto"}}
    with pytest.raises(ConfigError, match="trainer.precision is 'auto' here but 'fp32'"):
        check_resume(saved, megatron_auto, tmp_path, False)  # (bf16 on a GPU)


def test_resume_compares_the_precision_a_checkpoint_trained_in_with_the_built_engines(tmp_path):
    """A checkpoint records the precision its engine trained in (``auto`` resolved): a resume
    compares that with the built engine's (megatron's auto is bf16 on a GPU, fp32 on the CPU),
    not trainer.precision's text, and refuses another unless forced."""
    from embodied.checkpoint import load_checkpoint
    from embodied.learner import TorchEngine
    from embodied.resume import check_resume, load_resumed
    from embodied.roles import save_engine

    def engine(seed: int) -> TorchEngine:
        torch.manual_seed(seed)
        return TorchEngine(torch.nn.Linear(3, 2), learning_rate=1e-3, max_grad_norm=1.0)

    saved = engine(0)
    save_engine(saved, tmp_path, 1, meta={"config": {}}, counters={"iteration": 1})
    checkpoint = load_checkpoint(tmp_path / "last")
    assert checkpoint["meta"]["precision"] == "fp32"
    auto = {"trainer": {"backend": "megatron", "precision": "auto", "tensor_parallel": 1}}
    fp32 = {"trainer": {**auto["trainer"], "precision": "fp32"}}
    check_resume(fp32, auto, tmp_path, False, "fp32")  # (compared when built)
    resumed = engine(1)
    load_resumed(resumed, checkpoint, False)
    assert torch.equal(resumed.policy.weight, saved.policy.weight)
    checkpoint["meta"]["precision"] = "bf16"  # (a megatron run's on a GPU, auto)
    with pytest.raises(ConfigError, match="trained in bf16 but this run trains in fp32"):
        load_resumed(engine(1), checkpoint, False)
    load_resumed(engine(1), checkpoint, True)


def test_a_compiled_act_takes_a_fixed_number_of_pipeline_stages():
    overrides = ["policy.compile_act=true", "runner.pipeline_stages=auto"]
    with pytest.raises(ConfigError, match="policy.compile_act compiles the act once per batch"):
        load_config(TrainConfig, "configs/mujoco/push_ppo.yaml", overrides)
    cfg, _ = load_config(TrainConfig, "configs/mujoco/push_ppo.yaml", overrides[:1])
    assert cfg.policy.compile_act and cfg.runner.pipeline_stages == 1


@pytest.mark.parametrize(
    "path", ["configs/mujoco/reach_ppo.yaml", "configs/maniskill/multitask_vla_grpo.yaml"]
)
def test_the_bounds_that_inf_turns_off_take_it(path):
    """``.inf`` is a value for the bounds a schema names in INFINITE (no clipping, no time
    limit) and for no other float (tests/test_config_ranges.py)."""
    cfg, _ = load_config(TrainConfig, path, [])
    sections = {"algorithm": cfg.algorithm, "runner": cfg.runner}
    overrides = [f"{s}.{name}=.inf" for s, obj in sections.items() for name in obj.INFINITE]
    assert len(overrides) >= 6
    cfg, _ = load_config(TrainConfig, path, overrides)
    for obj in (cfg.algorithm, cfg.runner):
        assert [getattr(obj, name) for name in obj.INFINITE] == [float("inf")] * len(obj.INFINITE)
