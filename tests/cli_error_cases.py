"""The bad inputs of test_cli_errors.py: (argv, what the one-line error must name) per case;
``{root}``, ``{run}``, ``{ckpt}`` and ``{goal}`` are filled in from its ``paths`` fixture."""

import importlib.util

import pytest
from tiny_runs import TINY_REACH

TINY = [
    *TINY_REACH,
    "runner.video=false",
    "policy.hidden_sizes=[32]",
    "policy.use_privileged=false",  # deployable: reads only what an arm measures
]
needs_maniskill = pytest.mark.skipif(
    importlib.util.find_spec("mani_skill") is None, reason="needs ManiSkill"
)


M = "configs/mujoco/reach_ppo.yaml"
V = "configs/maniskill/multitask_vla_grpo.yaml"
MS = "configs/maniskill/pushcube_ppo.yaml"
SUITE = "configs/bench/smoke.yaml"
R = "{root}"
CK = "{ckpt}"
# (argv, what the line must name); {root}, {run}, {ckpt} and {goal} are filled in from `paths`
CASES = [
    # train: config files
    (["train", f"{R}/missing.yaml"], ["config file not found", "missing.yaml"]),
    (["train", f"{R}/empty.yaml"], ["empty.yaml", "config file is empty"]),
    (["train", f"{R}/comments.yaml"], ["comments.yaml", "config file is empty"]),
    (["train", f"{R}/invalid.yaml"], ["invalid.yaml line 2", "invalid YAML"]),
    (["train", f"{R}/list.yaml"], ["list.yaml", "must be a mapping"]),
    (["train", f"{R}/cycle_a.yaml"], ["defaults form a cycle", "cycle_a.yaml -> ", "cycle_b"]),
    (["train", f"{R}/defaults_text.yaml"], ["defaults_text.yaml", "'defaults' must be a list"]),
    # train: keys, types, overrides
    (["train", M, "env.num_envz=3"], ["env.num_envz", "unknown key", "the command line"]),
    (["train", M, "env.num_envs=many"], ["env.num_envs", "'many'"]),
    (["train", M, "env=3"], ["env:", "expected a section"]),
    (["train", M, "env.num_envs"], ["'env.num_envs'", "expected key.sub=value"]),
    (["train", M, "env..x=3"], ["'env..x=3'", "expected key.sub=value"]),
    (["train", M, "policy.name=gpt"], ["policy.name", "'gpt'"]),
    (["train", M, "algorithm.name=sac"], ["algorithm.name", "'sac'"]),
    (["train", M, "env.simulator=isaac"], ["env.simulator", "'isaac'"]),
    (["train", M, "env.task=fly"], ["env.task", "'fly'"]),
    (["train", M, "env.num_envs=0"], ["env.num_envs", "must be >= 1"]),
    (["train", MS, "env.tasks=[PushCube-v1,PullCube-v1]", "env.num_envs=3"], ["env.num_envs"]),
    (["train", MS, "env.tasks=[PushCube-v1,PushCube-v1]"], ["env.tasks", "listed twice"]),
    # train: what sections ask of each other, before anything is built
    (
        ["train", "configs/maniskill/multitask_vla_grpo.yaml", "algorithm.group_size=64"],
        ["algorithm.group_size", "64"],
    ),
    (["train", f"{R}/vla_ppo.yaml"], ["algorithm.name", "critic", "policy.value_head=true"]),
    (["train", f"{R}/vla_state.yaml"], ["env.obs_mode", "'vla'", "camera"]),
    # train: checkpoints to resume or start from
    (["train", M, f"runner.resume={R}/nowhere"], ["runner.resume", "nowhere"]),
    (["train", M, "runner.pipeline_stages=two"], ["runner.pipeline_stages", "or auto", "'two'"]),
    (
        ["train", M, f"runner.init_from={R}/nowhere", f"runner.output_dir={R}/out"],
        ["runner.init_from", "nowhere"],
    ),
    (["train", M, f"runner.resume={R}/corrupt_meta"], ["runner.resume", "corrupt_meta/meta.json"]),
    (
        ["train", M, f"runner.resume={R}/corrupt_trainer"],
        ["runner.resume", "corrupt_trainer/trainer.pt: cannot be read", "damaged"],
    ),
    (
        ["train", M, f"runner.init_from={R}/corrupt_weights", f"runner.output_dir={R}/out"],
        ["runner.init_from", "corrupt_weights/model.safetensors"],
    ),
    (
        ["train", M, "runner.resume={run}", *TINY, "algorithm.gamma=0.5"],
        ["runner.resume", "algorithm.gamma is 0.5 here but 0.8", "resume_force"],
    ),
    # train: ManiSkill tasks are checked before any worker starts
    pytest.param(
        ["train", MS, "env.task=PushCubee-v1", f"runner.output_dir={R}/ms"],
        ["'PushCubee-v1'", "did you mean 'PushCube-v1'"],
        marks=needs_maniskill,
    ),
    pytest.param(  # (the default normalized_dense, which the task does not compute)
        ["train", MS, "env.task=StackPyramid-v1", f"runner.output_dir={R}/ms"],
        ["env.reward_mode", "StackPyramid-v1 rewards none, sparse, not 'normalized_dense'"],
        marks=needs_maniskill,
    ),
    pytest.param(
        ["train", MS, "env.control_mode=pd_ee_delta_posx", f"runner.output_dir={R}/ms"],
        ["env.control_mode", "PushCube-v1's robot (panda)", "not 'pd_ee_delta_posx'"],
        marks=needs_maniskill,
    ),
    pytest.param(
        ["train", MS, "env.tasks=[PushCube-v1,PullCubee-v1]", f"runner.output_dir={R}/ms"],
        ["'PullCubee-v1'"],
        marks=needs_maniskill,
    ),
    # eval
    (["eval", f"{R}/nowhere"], ["no checkpoint at", "nowhere"]),
    (["eval", f"{R}/no_checkpoint"], ["no checkpoint at", "no_checkpoint"]),
    (["eval", f"{R}/corrupt_meta"], ["corrupt_meta/meta.json", "not valid JSON"]),
    (["eval", f"{R}/empty_meta"], ["empty_meta/meta.json", "'config'"]),
    (["eval", f"{R}/list_meta"], ["list_meta/meta.json: expected a JSON object, got list"]),
    (["eval", f"{R}/corrupt_weights"], ["corrupt_weights/model.safetensors", "damaged"]),
    (["eval", CK, "env.simulator=maniskill"], ["env.simulator=maniskill", "trained on mujoco"]),
    (["eval", CK, "--episodes", "0"], ["--episodes", "got 0"]),
    (["eval", CK, "--num-envs", "0"], ["--num-envs", "got 0"]),
    (["eval", CK, "--episodes", "x"], ["--episodes", "'x'"]),
    # sft
    (["sft", f"{R}/empty.yaml"], ["empty.yaml", "config file is empty"]),
    (["sft", "configs/maniskill/multitask_vla_sft.yaml", "datasets=[]"], ["datasets"]),
    (
        [
            "sft",
            "configs/maniskill/multitask_vla_sft.yaml",
            f"datasets=[{R}/nowhere]",
            f"runner.output_dir={R}/sft",
        ],
        ["nowhere", "not a complete LeRobot dataset"],
    ),
    (["sft", "configs/maniskill/multitask_vla_sft.yaml", "steps=0"], ["steps: must be >= 1"]),
    (
        ["sft", "configs/maniskill/multitask_vla_sft.yaml", "max_grad_norm=0"],
        ["max_grad_norm: must be > 0 (.inf: no clipping), got 0.0"],
    ),
    (
        ["sft", "configs/maniskill/multitask_vla_sft.yaml", "env.obs_mode=state"],
        ["env.obs_mode", "camera"],
    ),
    # demos
    (["demos", f"{R}/demos_no_expert.yaml"], ["expert", "required"]),
    (
        ["demos", "configs/maniskill/demos_pushcube.yaml", f"expert={R}/nowhere"],
        ["expert: no checkpoint at", "nowhere"],
    ),
    (
        ["demos", "configs/maniskill/demos_pushcube.yaml", f"expert={CK}", f"output={R}/dataset"],
        ["output", "dataset", "already holds a dataset"],
    ),
    (
        ["demos", "configs/maniskill/demos_pushcube.yaml", f"expert={CK}", f"output={R}/leftover"],
        ["output", "leftover is not empty"],
    ),
    (["demos", "configs/mujoco/demos_pick.yaml", "seed=-1"], ["seed: must be an integer in"]),
    (
        ["demos", "configs/maniskill/demos_pushcube.yaml", f"output={R}/empty.yaml"],
        ["output", "empty.yaml", "is a file"],
    ),
    (["demos", "configs/maniskill/demos_pushcube.yaml", "env.obs_mode=state"], ["env.obs_mode"]),
    (
        ["demos", "configs/mujoco/demos_pick.yaml", "max_attempts=10"],
        ["max_attempts: 10 is fewer than episodes (50)", "(in the command line)"],
    ),
    (
        ["demos", "configs/maniskill/demos_pushcube.yaml", "env.tasks=[PushCube-v1,PullCube-v1]"],
        ["env.tasks: a dataset holds one task's demonstrations; set env.task"],
    ),
    # bench
    (["bench", f"{R}/missing.yaml"], ["config file not found", "missing.yaml"]),
    (["bench", f"{R}/empty.yaml"], ["empty.yaml", "config file is empty"]),
    (["bench", f"{R}/no_tasks.yaml"], ["tasks", "at least one task"]),
    (["bench", SUITE, "--policy", "zero", "--checkpoint", CK], ["--policy", "--checkpoint"]),
    (["bench", SUITE, "--policy", "gpt"], ["--policy", "'gpt'"]),
    (["bench", SUITE, "--checkpoint", f"{R}/nowhere"], ["no checkpoint at", "nowhere"]),
    (["bench", SUITE, "episodes=0"], ["episodes", "got 0"]),
    (["bench", SUITE, "--out", f"{R}/empty.yaml"], ["--out", "empty.yaml", "is a file"]),
    (
        ["bench", SUITE, "tasks=[{env: {simulator: mujoco}}, {env: {simulator: mujoco}}]"],
        ["tasks share a name", "'mujoco/reach'", "give them other `name:`s (in the command line)"],
    ),
    (
        [
            "bench",
            SUITE,
            "tasks=[{env: {simulator: mujoco}, name: a/b}, {env: {simulator: mujoco}, name: a_b}]",
        ],
        ["tasks share a name or the file name of one (['a/b', 'a_b'])"],
    ),
    (
        ["bench", SUITE, "tasks=[{env: {simulator: mujoco}, sweep: {task: []}}]"],
        ["tasks[0].sweep.task: an empty list runs no task"],
    ),
    (["bench", SUITE, "torch_threads=0"], ["torch_threads: must be >= 1, got 0"]),
    (
        ["bench", SUITE, "tasks=[{env: {simulator: mujoco}, episodes: -1}]"],
        ["tasks[0].episodes: must be >= 0 (0: the suite's), got -1"],
    ),
    (["bench", SUITE, "name=../x"], ["name: a folder inside output_dir", "'../x'"]),
    (
        ["bench", SUITE, "tasks=[{env: {simulator: mujoco, task: fly}}]"],
        ["tasks[0].env.task", "'fly'"],
    ),
    (
        ["bench", SUITE, "tasks=[{env: {simulator: gazebo}}]"],
        ["tasks[0].env.simulator", "'gazebo'"],
    ),
    (
        ["bench", SUITE, "tasks=[{env: {simulator: mujoco}}, {env: {task: PushCubee-v1}}]"],
        ["tasks[1].env.simulator: missing"],
    ),
    pytest.param(
        [
            "bench",
            SUITE,
            "tasks=[{env: {simulator: mujoco}}, {env: {simulator: maniskill, task: PushCubee-v1}}]",
        ],
        ["tasks[1]", "'PushCubee-v1'"],
        marks=needs_maniskill,
    ),
    # serve
    (["serve", f"{R}/nowhere"], ["no checkpoint at", "nowhere"]),
    (["serve", f"{R}/corrupt_meta"], ["corrupt_meta/meta.json"]),
    (["serve", CK, "--port", "70000"], ["--port", "70000"]),
    (["serve", CK, "--queue", "0"], ["--queue", "got 0"]),
    (["serve", CK, "--device", "tpu"], ["--device: must be auto, cpu, cuda or cuda:N, got 'tpu'"]),
    (
        ["deploy", CK, "--robot", "so101-sim", "--device", "tpu"],
        ["--device: must be auto, cpu, cuda or cuda:N, got 'tpu'"],
    ),
    # deploy (--robot so101-sim: the MuJoCo twin; a real arm's cases fail before connecting)
    (["deploy", f"{R}/nowhere", "--robot", "so101-sim"], ["no checkpoint at", "nowhere"]),
    (["deploy", CK, "--robot", "so101-sim", "--camera", "wrist"], ["--camera 'wrist'"]),
    (  # (the twin's cameras are checked before the checkpoint is read: none here)
        ["deploy", f"{R}/nowhere", "--robot", "so101-sim", "--camera", "top=side"],
        ["camera: the twin has cameras ['front', 'wrist'], not ['top']"],
    ),
    (
        ["deploy", CK, "--robot", "so101-sim", "--robot.joint-signs", "1,-1"],
        ["--robot.joint-signs '1,-1'", "6"],
    ),
    (["deploy", CK, "--robot", "r2d2"], ["robot", "'r2d2'"]),
    (  # (a path under a file: the episode ran on the arm, then a traceback)
        ["deploy", CK, "--robot", "so101-sim", "--record", f"{R}/empty.yaml/rec"],
        ["--record", "empty.yaml/rec: cannot be made (Not a directory)"],
    ),
    (  # (a real arm: the policy would act without the goal, reported as given)
        ["deploy", CK, "--robot", "so101", "--robot.port", "/dev/ttyNONE", "--goal", "0.2,0,0.1"],
        ["--goal: the policy reads no goal", "policy.privileged_keys=[goal_pos]"],
    ),
    (["deploy", CK, "--robot", "koch", "--robot.port", "/dev/ttyACM0"], ["koch", "rest pose"]),
    (["deploy", CK, "--robot", "so101"], ["robot.port"]),
    (["deploy", CK, "--robot", "so101-sim", "--hz", "0"], ["--hz", "got 0"]),
    (["deploy", CK, "--robot", "so101-sim", "--episodes", "0"], ["--episodes", "got 0"]),
    (
        ["deploy", CK, "--robot", "so101-sim", "--goal", "10,10,10"],
        ["--goal '10,10,10': outside the box", "y in [-0.45, 0.45], z in [0.0, 0.55] m"],
    ),
    (
        ["deploy", CK, "--robot", "so101", "--robot.port", "/dev/ttyACM0", "--goal", "0.2,0,-0.1"],
        ["'0.2,0,-0.1': outside the box"],
    ),
    (["deploy", CK, "--robot", "so101-sim", "--episode-seconds", "-1"], ["--episode-seconds"]),
    (["deploy", CK, "--robot", "so101-sim", "--episode-seconds", "inf"], ["finite, got inf"]),
    (["deploy", CK, "--robot", "so101-sim", "--hz", "inf"], ["--hz", "finite (Hz), got inf"]),
    (
        ["deploy", CK, "--robot", "so101-sim", "--robot.joint-offsets", "nan,0,0,0,0,0"],
        ["--robot.joint-offsets 'nan,0,0,0,0,0'", "finite numbers"],
    ),
    (["read-arm", "--robot", "so101"], ["robot.port"]),
    (["deploy", CK, "--robot", "so101-sim", "--robot.watchdog", "0"], ["robot.watchdog", "got 0"]),
    (
        ["deploy", CK, "--robot", "so101-sim", "--robot.watchdog", "inf"],
        ["robot.watchdog", "got inf"],
    ),
    (["read-arm", "--robot", "so101-sim", "--readings", "0"], ["--readings: must be >= 1"]),
    (["deploy", CK, "--robot", "so101-sim", "--robot.max-speed", "0"], ["max_speed", "got 0"]),
    (["deploy", CK, "--robot", "so101-sim", "--robot.max-speed", "nan"], ["max_speed", "nan"]),
    # (100 for 1.00: 5 rad a step, past any joint's range: no rate limit, the safe pose's move too)
    (
        ["deploy", CK, "--robot", "so101-sim", "--robot.max-speed", "100"],
        ["robot.max_speed", "at most 4.7", "got 100"],
    ),
    (
        [
            "deploy",
            CK,
            "--robot",
            "so101-sim",
            "--camera",
            "front=front",
            "--camera",
            "front=wrist",
        ],
        ["--camera front: given twice ('front' and 'wrist')"],
    ),
    (
        ["deploy", CK, "--robot", "so101-sim", "--robot.gripper-range", "1.7,-0.2"],
        ["robot.gripper_range", "the first smaller, got (1.7, -0.2)"],
    ),
    (
        ["read-arm", "--robot", "so101-sim", "--robot.gripper-range", "0.1"],
        ["--robot.gripper-range '0.1': expected 2 comma-separated finite numbers"],
    ),
    (["read-arm", "--robot", "so101-sim", "--hz", "inf"], ["--hz", "0.1 to 100, got inf"]),
    (["read-arm", "--robot", "so101-sim", "--hz", "1e-300"], ["--hz", "0.1 to 100, got 1e-300"]),
    # the robot and its port are checked before the checkpoint is read (none here)
    (["deploy", f"{R}/nowhere", "--robot", "r2d2"], ["robot", "'r2d2'"]),
    (["deploy", f"{R}/nowhere", "--robot", "so101"], ["robot.port"]),
    (["deploy", CK, "--robot", "so101-sim", "--server", "http://host:1"], ["'http://host:1'"]),
    (["deploy", CK, "--robot", "so101-sim", "--record", f"{R}/dataset"], ["--record", "dataset"]),
    (
        ["deploy", CK, "--robot", "so101-sim", "--server", "ws://127.0.0.1:1"],
        ["ws://127.0.0.1:1", "cannot connect"],
    ),
    (
        ["deploy", "{goal}", "--robot", "so101", "--robot.port", "/dev/ttyACM0"],
        ["simulator-only inputs", "policy.use_privileged=false"],
    ),
    # replay and episodes: their options before any record is read, then the record
    (["replay", f"{R}/run", "--iteration", "1", "--rtol", "-1"], ["--rtol: must be >= 0"]),
    (["replay", f"{R}/run", "--iteration", "1", "--device", "tpu"], ["--device", "'tpu'"]),
    (["replay", f"{R}/cut_record", "--iteration", "1"], ["record.json: damaged (JSONDecode"]),
    (
        ["replay", f"{R}/list_record", "--iteration", "1"],
        ["record.json: damaged (not a JSON object)"],
    ),
    (["episodes", f"{R}/run", "--best", "-1"], ["--best: must be >= 0 (episodes), got -1"]),
    (["episodes", f"{R}/run", "--worst", "-2"], ["--worst: must be >= 0 (episodes), got -2"]),
    (["episodes", f"{R}/run", "--atol", "-1"], ["--atol: must be >= 0, got -1"]),
    (["episodes", f"{R}/run", "--out", f"{R}/empty.yaml"], ["--out", "empty.yaml: is a file"]),
    (
        ["episodes", f"{R}/run", "--to-dataset", f"{R}/empty.yaml/x"],
        ["--to-dataset", "empty.yaml/x: is inside", "empty.yaml, a file"],
    ),
    (["convert", CK, "--to", "torch", f"{R}/empty.yaml/x"], ["is inside", "empty.yaml, a file"]),
    (["bench", SUITE, "--out", f"{R}/broken/x"], ["is inside", "broken, a broken link"]),
    (
        ["bench", SUITE, "tasks=[{env: {simulator: mujoco, randomize: {friction: .nan}}}]"],
        ["tasks[0].env.randomize.friction: not a number"],
    ),
    (["eval", CK, "env.randomize.friction=nan"], ["env.randomize.friction: not a number"]),
    (["bench", SUITE, "--out", f"{R}/empty.yaml/x"], ["--out", "is inside", "empty.yaml, a file"]),
    # the cluster block (checked before Ray starts) and cluster status
    (["train", M, "cluster.placement=everywhere"], ["cluster.placement", "'everywhere'"]),
    (["train", M, "cluster.env.workers=0"], ["cluster.env.workers", "must be >= 1"]),
    (["train", M, "cluster.rollout.num_gpus=1.5"], ["cluster.rollout.num_gpus", "whole"]),
    (["train", M, "cluster.weight_sync=nccl"], ["cluster.weight_sync", "broadcast", "'nccl'"]),
    (
        ["train", M, "runner.replay_from=/nowhere/rollouts"],
        ["runner.replay_from", "/nowhere/rollouts", "no rollout records"],
    ),
    (
        ["train", M, "runner.replay_from=/nowhere", "cluster.enabled=true"],
        ["runner.replay_from", "cluster.enabled=false"],
    ),
    (["train", M, "runner.record_rollouts=-1"], ["runner.record_rollouts", "-1"]),
    (
        ["train", M, "cluster.weight_sync=shared", "cluster.placement=hybrid"],
        ["cluster.weight_sync", "actor's memory", "collocated, not hybrid"],
    ),
    (
        ["train", M, "cluster.rollout.workers=0", "cluster.rollout.num_gpus=1"],
        ["cluster.rollout.num_gpus", "env.num_gpus"],
    ),
    (["train", M, "cluster.actor.resources.sim=-1"], ["cluster.actor.resources", "sim"]),
    (["train", M, "cluster.max_staleness=1"], ["cluster.max_staleness", "cluster.enabled=true"]),
    (
        ["train", V, "algorithm.groups_per_batch=10"],
        ["algorithm.groups_per_batch: 10 groups, but an update's 3 rounds", "give at most 9"],
    ),
    (
        ["train", M, "cluster.enabled=true", "cluster.max_staleness=2"],
        ["cluster.max_staleness", "got 2"],
    ),
    # the trainer block
    (["train", M, "trainer.backend=jax"], ["trainer.backend", "'jax'", "megatron"]),
    (["train", M, "trainer.tensor_parallel=2"], ["trainer.tensor_parallel", "backend=megatron"]),
    (["train", M, "trainer.backend=megatron"], ["trainer.backend", "policy.name=vla"]),
    (
        ["train", V, "trainer.backend=megatron", "trainer.tensor_parallel=3"],
        ["trainer.tensor_parallel", "4 attention heads", "3 ranks"],
    ),
    (
        [
            "train",
            V,
            "trainer.backend=megatron",
            "trainer.tensor_parallel=2",
            "cluster.enabled=true",
        ],
        ["cluster.actor.workers", "each megatron TP rank is an actor worker", "set it to 2"],
    ),
    (
        ["train", V, "trainer.backend=megatron", "cluster.offload_optimizer=true"],
        ["cluster.offload_optimizer", "megatron"],
    ),
    (["cluster", "status", f"{R}/nowhere"], ["nowhere", "no such run directory"]),
    (["cluster", "status", "{run}"], ["no cluster.json", "not a cluster run"]),
    (["cluster", "stop", "{run}"], ["'stop'"]),
    # convert
    (["convert", f"{R}/nowhere", "--to", "torch", f"{R}/o"], ["nowhere: no such file"]),
    (
        ["convert", R, "--to", "torch", f"{R}/o"],
        ["no checkpoint at", "nor is it a Hugging Face model directory (config.json)"],
    ),
    (["convert", CK, "--to", "tpu", f"{R}/o"], ["--to", "'tpu'"]),
    (["convert", f"{R}/no_weights", "--to", "torch", f"{R}/o"], ["no_weights/model.safetensors"]),
    (["convert", CK, "--to", "torch", "--tensor-parallel", "2", f"{R}/o"], ["--to megatron only"]),
    (["convert", CK, "--to", "megatron", "--tensor-parallel", "0", f"{R}/o"], ["at least 1"]),
    (["convert", CK, "--to", "torch", f"{R}/run"], ["run exists", "new directory"]),
    (
        ["convert", CK, "--to", "megatron", f"{R}/o"],
        ["nothing the megatron backend shards", "policy.name='actor_critic'"],
    ),
    (["convert", CK, "--to", "hf", f"{R}/o"], ["holds no Hugging Face model", "--to torch"]),
    # the command line itself
    (["frobnicate"], ["'frobnicate'"]),
    (["train"], ["config"]),
]


# known only once the environment is built (its spec: inputs, keys, camera sizes)
BUILT_CASES = [
    # train: still one line, and no run directory
    (
        ["train", M, "policy.privileged_keys=[nope]"],
        ["policy.privileged_keys: ['nope'] not among the environment's ['goal_pos', 'tcp_pos']"],
    ),
    (
        ["train", f"{R}/vla_rgb.yaml", "policy.privileged_keys=[nope]"],
        ["policy.privileged_keys: ['nope'] not among the environment's ['goal_pos', 'tcp_pos']"],
    ),
    (
        ["train", M, "env.obs_mode=rgb", "env.image_size=32"],
        ["env.image_size: the actor-critic's CNN needs images of at least 36x36", "got 32x32"],
    ),
    # eval: the environment's inputs against the checkpoint's
    (
        ["eval", CK, "env.obs_mode=rgb"],
        ["env.obs_mode=rgb", "trained with other inputs", "cameras [] -> ['base_camera']"],
    ),
    (["eval", "{goal}", "env.task=push"], ["env.task=push", "weights do not fit", "shape"]),
    # demos
    (
        ["demos", "configs/mujoco/demos_push.yaml", "privileged_keys=[nope]", f"output={R}/d"],
        ["privileged_keys: ['nope'] not among the environment's ['cube_pos', 'goal_pos'"],
    ),
]
