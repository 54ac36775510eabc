"""Control loop: achieved rate and jitter at 30 and 50 Hz, policy in process vs on a policy server
over loopback, on the digital twin (LeRobot's SO-101 driver, software serial port, MuJoCo arm).

The policy is an MLP actor-critic (256x2, with a CNN on one 96 px camera unless --no-camera) built
on the arm's spec with random weights: timing does not depend on what it learned. Each
configuration runs --seconds of control; the loop's lateness past each deadline gives the jitter
(p50/p99/max), the server's round trip is measured by the client per request.

    python benchmarks/control_loop.py [--seconds 10] [--rates 30 50] [--no-camera]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _setup(camera: bool, hz: float):
    from embodied.models import ActorCritic, ActorCriticConfig
    from embodied.robots.arm import ArmConfig, RobotEnv, connect, default_safety
    from embodied.robots.safety import SafetyLayer
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(
        robot="so101-sim",
        calibration_dir=tempfile.mkdtemp(),
        cameras={"front": "front"} if camera else {},
        image_size=96,
        control_hz=hz,
    )
    robot, twin, _ = make_twin_robot(cfg)
    connect(robot, cfg)
    env = RobotEnv(robot, cfg, SafetyLayer(default_safety(robot, cfg)))
    torch.manual_seed(0)
    policy = ActorCritic(
        env.spec, ActorCriticConfig(hidden_sizes=[256, 256], use_privileged=False)
    ).eval()
    return env, twin, policy


def _chunk(policy, obs, K: int = 8) -> np.ndarray:
    """The policy's forward pass (the cost measured), then a chunk that holds the arm where it
    is."""
    with torch.no_grad():
        policy.act(obs, deterministic=True)
    return np.repeat(obs.state[:, :6].numpy(), K, 0)  # f32 [K, 6]


def run(hz: float, remote: bool, seconds: float, camera: bool) -> dict:
    from embodied.deploy_policy import obs_to_wire, wire_to_obs
    from embodied.robots.control import ChunkExecutor, EmergencyStop, run_episode
    from embodied.robots.server import PolicyClient, PolicyServer
    from embodied.robots.shutdown import safe_shutdown

    env, twin, policy = _setup(camera, hz)
    server = client = None
    try:
        if remote:
            contract = {"bench": 1}
            server = PolicyServer(
                lambda msg: _chunk(policy, wire_to_obs(msg, env.spec)), contract, port=0
            ).start()
            client = PolicyClient(f"ws://127.0.0.1:{server.port}", contract)
            infer = lambda obs: client.infer(obs_to_wire(obs))  # noqa: E731
        else:
            infer = lambda obs: _chunk(policy, obs)  # noqa: E731
        ex = ChunkExecutor(infer, request_when_left=3, blend_steps=2)
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=hz, max_steps=int(seconds * hz))
        ex.close()
        t = [f["t"] for f in result.frames]
        out = {
            "hz": hz,
            "inference": "server (loopback)" if remote else "in process",
            "steps": result.steps,
            **result.timing,  # (its achieved_hz, ticks over the timer's life, is replaced below)
            "achieved_hz": (len(t) - 1) / (t[-1] - t[0]),  # frames over their span, as recorded
            "end": result.reason,
            "watchdog_holds": result.watchdog.get("hold", 0),
        }
        if client is not None:
            rt = np.asarray(client.round_trip_ms)
            out.update(
                round_trip_p50_ms=float(np.percentile(rt, 50)),
                round_trip_p99_ms=float(np.percentile(rt, 99)),
            )
        safe_shutdown(env, hz=hz, timeout_s=5)
        return out
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()
        env.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rates", type=float, nargs="+", default=[30.0, 50.0])
    ap.add_argument("--no-camera", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, "
        f"camera: {'none' if args.no_camera else 'front 96 px'}"
    )
    print(
        "| rate (Hz) | inference | achieved (Hz) | jitter p50 (ms) | p99 (ms) | max (ms) | "
        "inference p50 (ms) | server round trip p50 / p99 (ms) | watchdog holds |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for hz in args.rates:
        for remote in (False, True):
            r = run(hz, remote, args.seconds, not args.no_camera)
            rt = f"{r['round_trip_p50_ms']:.1f} / {r['round_trip_p99_ms']:.1f}" if remote else "-"
            print(
                f"| {hz:.0f} | {r['inference']} | {r['achieved_hz']:.1f} | "
                f"{r['jitter_p50_ms']:.2f} | {r['jitter_p99_ms']:.2f} | {r['jitter_max_ms']:.1f} | "
                f"{r['inference_ms_p50']:.1f} | {rt} | {r['watchdog_holds']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
