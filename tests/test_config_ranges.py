"""Each config section's own checks (its validate()) through the CLI: a value out of range is
one line naming the key and where it was set, before anything is built (tests/one_line.py)."""

import pytest
from one_line import fill, one_line_error, params, run_cli

M = "configs/mujoco/reach_ppo.yaml"
V = "configs/maniskill/multitask_vla_grpo.yaml"
MS = "configs/maniskill/pushcube_ppo.yaml"
SFT = "configs/maniskill/multitask_vla_sft.yaml"
SMOL = "configs/maniskill/multitask_smolvla_grpo.yaml"
R = "{root}"
CASES = [
    # each section's own checks (validate()), named at their key and where it was set
    (["train", M, "runner.eval_episodes=0"], ["runner.eval_episodes: must be >= 1, got 0"]),
    (["train", M, "runner.final_eval_episodes=0"], ["runner.final_eval_episodes", "got 0"]),
    # LIBERO's 50 initial states per task: a 51st episode repeats the first (no new evidence)
    (
        ["train", "configs/libero/spatial_ppo_state.yaml", "runner.final_eval_episodes=100"],
        ["runner.final_eval_episodes: 100, but libero has 50 distinct episodes per task"],
    ),
    (
        ["sft", SFT, "env={simulator: libero, obs_mode: rgb}", "runner.eval_episodes=51"],
        ["runner.eval_episodes: 51", "50 or fewer"],
    ),
    (["train", M, "runner.spike_factor=-1"], ["runner.spike_factor: 0 (no spikes)", "-1.0"]),
    (["train", M, "runner.keep_rollouts=0"], ["runner.keep_rollouts: must be >= 1"]),
    (["train", M, "runner.keep_checkpoints=0"], ["runner.keep_checkpoints: must be >= 1"]),
    (["train", M, "runner.torch_threads=0"], ["runner.torch_threads: must be >= 1"]),
    (["train", M, "runner.max_minutes=0"], ["runner.max_minutes: must be > 0", "command line"]),
    (
        ["train", M, f"runner.replay_from={R}/x", f"runner.resume={R}/y"],
        ["runner.replay_from", "cannot resume"],
    ),
    (["train", M, "algorithm.gamma=0"], ["algorithm.gamma: must be in (0, 1], got 0.0"]),
    (["train", M, "algorithm.gae_lambda=2"], ["algorithm.gae_lambda: must be in [0, 1]"]),
    (["train", M, "algorithm.learning_rate=0"], ["algorithm.learning_rate: must be > 0"]),
    (["train", M, "algorithm.num_steps=0"], ["algorithm.num_steps: must be >= 1, got 0"]),
    (["train", V, "algorithm.group_size=1"], ["algorithm.group_size: must be >= 2, got 1"]),
    (["train", V, "algorithm.kl_coef=-1"], ["algorithm.kl_coef: must be >= 0"]),
    (["train", M, "policy.activation=swish"], ["policy.activation", "'relu'", "'swish'"]),
    (["train", M, "policy.chunk_size=0"], ["policy.chunk_size: must be >= 1, got 0"]),
    (["train", M, "policy.hidden_sizes=[]"], ["policy.hidden_sizes", "non-empty"]),
    (["train", M, "policy.image_features=0"], ["policy.image_features: must be >= 1, got 0"]),
    (["train", V, "policy.bins=1"], ["policy.bins: must be >= 2, got 1"]),
    (["train", V, "policy.flow_steps=0"], ["policy.flow_steps: must be >= 1, got 0"]),
    (["train", V, "policy.text_layers=-1"], ["policy.text_layers: must be >= 1, got -1"]),
    (["train", V, "policy.layers=0"], ["policy.layers: must be >= 1, got 0"]),
    (["train", V, "policy.heads=-2"], ["policy.heads: must be >= 1, got -2"]),
    (["train", V, "policy.d_model=0"], ["policy.d_model: must be >= 1, got 0"]),
    (
        ["train", V, f"policy.vlm_path={R}/moved"],
        ["policy.vlm_path:", "/moved is not a model directory (config.json"],
    ),
    (["train", V, "policy.vision_width=0"], ["policy.vision_width: must be > 0, got 0.0"]),
    (
        ["train", V, "policy.vision_depth=0.5"],  # (a traceback when the policy was built; then
        # an error naming vision_width and the file)
        [
            "policy.vision_depth: the pretrained EfficientNet-Lite0",
            "got 1.0 and 0.5",
            "command line",
        ],
    ),
    (["train", V, "policy.flow_noise_std=-1"], ["policy.flow_noise_std: must be > 0"]),
    (["train", V, "policy.flow_noise_std=0"], ["policy.flow_noise_std: must be > 0, got 0.0"]),
    (
        ["train", SMOL, f"policy.vlm_path={R}/x", "policy.flow_steps=0"],
        ["policy.flow_steps: must be >= 1, got 0"],
    ),
    (
        ["train", SMOL, f"policy.vlm_path={R}/x", "policy.image_size=-1"],
        ["policy.image_size: must be >= 0, got -1"],
    ),
    (
        ["train", SMOL, f"policy.vlm_path={R}/x", "policy.tokenizer_max_length=0"],
        ["policy.tokenizer_max_length: must be >= 1, got 0"],  # (no instruction token)
    ),
    (
        ["train", M, "policy.use_privileged=false", "policy.privileged_keys=[goal_pos]"],
        ["policy.privileged_keys", "use_privileged=true"],
    ),
    (["train", M, "env.obs_mode=depth"], ["env.obs_mode", "'depth'"]),
    (
        ["train", M, "env.randomize.friction=-1"],
        ["env.randomize.friction: must be >= 0, got -1.0 (in the command line)"],
    ),
    (["train", M, "env.randomize.mass=1.5"], ["env.randomize.mass: a relative range below 1"]),
    (["train", M, "trainer.tensor_parallel=0"], ["trainer.tensor_parallel: must be >= 1"]),
    (["train", M, "algorithm.clip_coef=0"], ["algorithm.clip_coef: must be > 0, got 0.0"]),
    (
        ["train", V, "algorithm.clip_coef_high=-1"],
        ["algorithm.clip_coef_high: must be > 0 or null"],
    ),
    (["train", M, "algorithm.max_grad_norm=0"], ["algorithm.max_grad_norm", "(.inf: no clipping)"]),
    (["train", V, "algorithm.max_grad_norm=-1"], ["algorithm.max_grad_norm: must be > 0"]),
    (["train", M, "algorithm.target_kl=-1"], ["algorithm.target_kl: must be > 0 or null"]),
    (["train", M, "algorithm.vf_coef=-1"], ["algorithm.vf_coef: must be >= 0"]),
    (["train", M, "algorithm.vf_clip=0"], ["algorithm.vf_clip: must be > 0 or null"]),
    (["train", M, "algorithm.reward_scale=0"], ["algorithm.reward_scale: must be > 0"]),
    (["train", M, "env.max_episode_steps=0"], ["env.max_episode_steps: must be >= 1 or null"]),
    (["train", MS, "env.max_episode_steps=-3"], ["env.max_episode_steps", "got -3"]),
    (["train", M, "env.home_noise=-1"], ["env.home_noise: must be >= 0"]),
    (["train", M, "runner.device=tpu"], ["runner.device: must be auto, cpu, cuda", "'tpu'"]),
    (
        ["train", M, f"runner.output_dir={R}/empty.yaml/runs"],
        ["runner.output_dir, runner.name: {root}/empty.yaml/runs/", "inside {root}/empty.yaml"],
    ),
    (
        ["train", M, f"runner.output_dir={R}/broken/runs"],
        ["runner.output_dir, runner.name:", "inside {root}/broken, a broken link"],
    ),
    # SFT's own (its runner's as the train runner's)
    (["sft", SFT, "learning_rate=0"], ["learning_rate: must be > 0, got 0.0"]),
    (["sft", SFT, "weight_decay=-1"], ["weight_decay: must be >= 0, got -1.0"]),
    (["sft", SFT, "warmup_steps=-1"], ["warmup_steps: must be >= 0, got -1"]),
    (["sft", SFT, "runner.eval_episodes=0"], ["runner.eval_episodes: must be >= 1, got 0"]),
    (["sft", SFT, "runner.save_every=-1"], ["runner.save_every: must be >= 0, got -1"]),
    (["sft", SFT, "runner.keep_checkpoints=0"], ["runner.keep_checkpoints: must be >= 1"]),
    (["sft", SFT, "runner.torch_threads=0"], ["runner.torch_threads: must be >= 1, got 0"]),
    (["sft", SFT, "runner.max_minutes=-1"], ["runner.max_minutes: must be > 0, got -1.0"]),
    # floats are numbers, and finite but for the bounds .inf turns off (as max_grad_norm's)
    (["train", M, "algorithm.learning_rate=nan"], ["algorithm.learning_rate: not a number"]),
    (["train", M, "algorithm.learning_rate=.inf"], ["algorithm.learning_rate: must be finite"]),
    (["train", V, "algorithm.kl_coef=-.inf"], ["algorithm.kl_coef: must be finite, got -inf"]),
    (["train", M, "algorithm.max_grad_norm=nan"], ["algorithm.max_grad_norm: not a number"]),
    (["train", M, "env.randomize.friction=nan"], ["env.randomize.friction: not a number"]),
    (["train", M, "cluster.sync_bucket_mb=.inf"], ["cluster.sync_bucket_mb: must be finite"]),
    (["sft", SFT, "learning_rate=.inf"], ["learning_rate: must be finite, got inf"]),
    # the run directory is output_dir/name: a name that leaves output_dir, or is it
    (["train", M, "runner.name=../x"], ["runner.name: a folder inside output_dir", "'../x'"]),
    (["train", M, f"runner.name={R}/abs"], ["runner.name: a folder inside output_dir", "/abs'"]),
    (["train", M, "runner.name=."], ["runner.name: a folder inside output_dir", "got '.'"]),
    (["train", M, 'runner.name=""'], ["runner.name: a folder inside output_dir", "got ''"]),
    (["sft", SFT, "runner.name=a/../.."], ["runner.name: a folder inside", "'a/../..'"]),
    (["train", M, "cluster.env.num_cpus=-1"], ["cluster.env.num_cpus: must be >= 0"]),
    (["train", M, "cluster.env.num_gpus=-1"], ["cluster.env.num_gpus: must be >= 0"]),
    (["train", M, "cluster.connect_timeout_s=0"], ["cluster.connect_timeout_s: must be > 0"]),
    (["train", M, "cluster.sync_bucket_mb=0"], ["cluster.sync_bucket_mb: must be > 0"]),
    (["train", M, "cluster.max_restarts=-1"], ["cluster.max_restarts: must be >= 0"]),
    (["train", M, "cluster.num_cpus=0"], ["cluster.num_cpus: must be >= 1", "got 0"]),
    (["train", M, "cluster.num_gpus=-1"], ["cluster.num_gpus: must be >= 0", "got -1"]),
    (
        ["train", M, "cluster.address=auto", "cluster.num_gpus=2"],
        ["cluster.num_gpus: sizes a Ray this run starts", "address auto has its own"],
    ),
    # a flow head has no log std to set: refused after the simulators were built
    (["train", V, "policy.head=flow"], ["algorithm.exploration_log_std: sets a Gaussian head"]),
    (["train", V, "policy.head=discrete"], ["policy 'vla' (head discrete) samples otherwise"]),
    # at 1 half the updates (and at 0.5 nearly all) were spikes, each record kept for good
    (["train", M, "runner.spike_factor=1"], ["runner.spike_factor: 0 (no spikes) or a multiple"]),
    (["train", M, "cluster.eval.workers=1"], ["cluster.eval.workers", "cluster.enabled=true"]),
    (
        [
            "train",
            M,
            "cluster.enabled=true",
            "cluster.rollout.workers=3",
            "cluster.env.workers=2",
        ],
        ["cluster.rollout.workers", "3 rollout workers for 2 env worker(s)"],
    ),
]


@pytest.mark.parametrize("argv, culprits", params(CASES))
def test_a_value_out_of_range_is_one_line_naming_its_key(argv, culprits, tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("")  # (a file where a directory is wanted)
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    paths = {"root": str(tmp_path)}
    # (a check that fails to refuse trains here, not in ./runs; a case's own output_dir wins)
    argv = [*argv[:2], f"runner.output_dir={tmp_path}/runs", *argv[2:]]
    rc, err = run_cli([fill(a, paths) for a in argv], capsys)
    one_line_error(rc, err, *[fill(c, paths) for c in culprits])
    assert not (tmp_path / "runs").exists()
