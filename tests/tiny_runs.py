"""Overrides that shrink configs/mujoco/reach_ppo.yaml to a run of seconds (4 environments, 32 env
steps, 2 evaluation episodes, 32-pixel cameras): a trained checkpoint for tests to act with."""

TINY_REACH = [
    "env.num_envs=4",
    "algorithm.num_steps=8",
    "runner.total_env_steps=32",
    "runner.eval_episodes=2",
    "runner.final_eval_episodes=2",
    "runner.progress=false",
    "env.render_size=32",
    "runner.video=false",  # (rendering would be most of such a run)
]
