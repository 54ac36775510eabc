"""How observations and actions should move between an env worker and a rollout worker (issue
33 item 1): the time of one exchange (observations out, a chunk back) by each mechanism, side by
side in one run, on this machine.

    python benchmarks/channels.py [--exchanges 400] [--repeats 5] [--images]

- ``relay``: the driver calls the env worker, then the rollout worker (the relayed mode so far:
  two Ray round trips through the driver per chunk);
- ``actor call``: the env worker calls the rollout worker itself (one Ray round trip, worker to
  worker; Ray routes the small objects through their owner, here the env worker);
- ``ray channel``: Ray's shared-memory channels (what compiled graphs run on), one each way;
- ``socket``: a Unix socket between the two processes (``multiprocessing.connection``), the
  arrays pickled with protocol 5.

The payload is the README config's (8 environments, state f32 [8, 42]; the reply: actions,
log-probabilities and values) or, with ``--images``, two 128 px cameras per environment. No
simulation and no inference: the times are the mechanism's own. Each repeat times every
mechanism once, in turn; the median is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

ENVS = 8


def observation(images: bool) -> dict:
    obs = {"state": np.zeros((ENVS, 42), np.float32)}
    if images:
        for camera in ("base", "hand"):
            obs[camera] = np.zeros((ENVS, 128, 128, 3), np.uint8)
    return obs


def reply() -> dict:
    return {
        "actions": np.zeros((ENVS, 1, 8), np.float32),
        "logprob": np.zeros(ENVS, np.float32),
        "value": np.zeros(ENVS, np.float32),
        "logp_token": np.zeros((ENVS, 1, 8), np.float32),
    }


class Side:
    """What both sides do: make a channel that they write and ``reader`` reads (Ray's channels
    are made by their writer), listen on a Unix socket."""

    def channel_to(self, reader, size: int):
        import ray
        from ray.experimental.channel import Channel

        context = ray.get_runtime_context()
        return Channel(context.current_actor, [(reader, context.get_node_id())], size)

    def listen(self) -> str:
        from multiprocessing.connection import Listener

        path = os.path.join(tempfile.mkdtemp(), "rollout.sock")
        self.listener = Listener(path, family="AF_UNIX")
        return path


class Waiter(Side):
    """The CPU a side burns while it waits ``seconds`` for a message that does not come."""

    def share(self, start_time: float, start_cpu: float) -> float:
        return (time.process_time() - start_cpu) / (time.time() - start_time)

    def wait_channel(self, inbox, seconds: float) -> float:
        inbox.ensure_registered_as_reader()
        start = (time.time(), time.process_time())
        try:
            inbox.read(timeout=seconds)
        except Exception:  # (the timeout: nothing was written)
            pass
        return self.share(*start)

    def wait_socket(self, seconds: float) -> float:
        with self.listener.accept() as conn:
            start = (time.time(), time.process_time())
            conn.poll(seconds)
            return self.share(*start)

    def wait_call(self, other, seconds: float) -> float:
        import ray

        start = (time.time(), time.process_time())
        ray.get(other.sleep.remote(seconds))
        return self.share(*start)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def hold_socket(self, path: str, seconds: float) -> None:
        from multiprocessing.connection import Client

        with Client(path, family="AF_UNIX"):
            time.sleep(seconds + 0.5)


class Rollout(Side):
    """The rollout worker's side: answers observations with a chunk."""

    def act(self, obs: dict) -> dict:
        return reply()

    def serve_channel(self, inbox, outbox, exchanges: int) -> None:
        inbox.ensure_registered_as_reader()
        outbox.ensure_registered_as_writer()
        for _ in range(exchanges):
            self.act(inbox.read())
            outbox.write(reply())

    def serve_socket(self, exchanges: int) -> None:
        with self.listener.accept() as conn:
            for _ in range(exchanges):
                self.act(conn.recv())
                conn.send(reply())


class Env(Side):
    """The env worker's side: sends observations, takes the chunk back."""

    def __init__(self, images: bool):
        self.obs = observation(images)

    def step(self, actions: dict) -> dict:
        return self.obs

    def by_actor_call(self, rollout, exchanges: int) -> float:
        import ray

        start = time.perf_counter()
        for _ in range(exchanges):
            ray.get(rollout.act.remote(self.obs))
        return time.perf_counter() - start

    def by_channel(self, outbox, inbox, exchanges: int) -> float:
        outbox.ensure_registered_as_writer()
        inbox.ensure_registered_as_reader()
        start = time.perf_counter()
        for _ in range(exchanges):
            outbox.write(self.obs)
            inbox.read()
        return time.perf_counter() - start

    def by_socket(self, path: str, exchanges: int) -> float:
        from multiprocessing.connection import Client

        with Client(path, family="AF_UNIX") as conn:
            start = time.perf_counter()
            for _ in range(exchanges):
                conn.send(self.obs)
                conn.recv()
            return time.perf_counter() - start


def relay(env, rollout, exchanges: int) -> float:
    import ray

    actions = reply()
    start = time.perf_counter()
    for _ in range(exchanges):
        obs = ray.get(env.step.remote(actions))
        actions = ray.get(rollout.act.remote(obs))
    return time.perf_counter() - start


def actor_call(env, rollout, exchanges: int) -> float:
    import ray

    return ray.get(env.by_actor_call.remote(rollout, exchanges))


CHANNELS: dict = {}  # made once: (env -> rollout, rollout -> env)


def ray_channel(env, rollout, exchanges: int) -> float:
    import ray

    if not CHANNELS:
        size = 4 * sum(a.nbytes for a in observation(True).values())  # (room for either)
        CHANNELS["pair"] = ray.get(
            [env.channel_to.remote(rollout, size), rollout.channel_to.remote(env, size)]
        )
    to_rollout, to_env = CHANNELS["pair"]
    served = rollout.serve_channel.remote(to_rollout, to_env, exchanges)
    seconds = ray.get(env.by_channel.remote(to_rollout, to_env, exchanges))
    ray.get(served)
    return seconds


def socket(env, rollout, exchanges: int) -> float:
    import ray

    path = ray.get(rollout.listen.remote())
    served = rollout.serve_socket.remote(exchanges)
    seconds = ray.get(env.by_socket.remote(path, exchanges))
    ray.get(served)
    return seconds


def waiting_cpu(seconds: float = 2.0) -> dict[str, float]:
    """Per mechanism, the share of a core the waiting side uses while nothing comes."""
    import ray

    waiter = ray.remote(Waiter).options(num_cpus=0.5).remote()
    other = ray.remote(Waiter).options(num_cpus=0.5).remote()
    channel = ray.get(other.channel_to.remote(waiter, 10_000))
    path = ray.get(waiter.listen.remote())
    socket_wait = waiter.wait_socket.remote(seconds)
    other.hold_socket.remote(path, seconds)
    return {
        "relay": ray.get(waiter.wait_call.remote(other, seconds)),  # (a ray.get, as relays do)
        "actor call": ray.get(waiter.wait_call.remote(other, seconds)),
        "ray channel": ray.get(waiter.wait_channel.remote(channel, seconds)),
        "socket": ray.get(socket_wait),
    }


MECHANISMS = {
    "relay": relay,
    "actor call": actor_call,
    "ray channel": ray_channel,
    "socket": socket,
}


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exchanges", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--images", action="store_true", help="two 128 px cameras per env")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    env = ray.remote(Env).options(num_cpus=0.5).remote(args.images)
    rollout = ray.remote(Rollout).options(num_cpus=0.5).remote()
    for mechanism in MECHANISMS.values():  # (warm-up: first calls, channel buffers)
        mechanism(env, rollout, 20)
    times: dict[str, list[float]] = {name: [] for name in MECHANISMS}
    for _ in range(args.repeats):
        for name, mechanism in MECHANISMS.items():
            times[name].append(mechanism(env, rollout, args.exchanges) / args.exchanges)
    payload = sum(a.nbytes for a in observation(args.images).values())
    print(f"{args.exchanges} exchanges x {args.repeats} repeats; observations {payload} B")
    idle = waiting_cpu()
    print("| mechanism | ms per exchange (median) | range | CPU of the side that waits |")
    print("|---|---|---|---|")
    for name, values in times.items():
        low, high = min(values) * 1e3, max(values) * 1e3
        median = statistics.median(values) * 1e3
        print(f"| {name} | {median:.3f} | {low:.3f}-{high:.3f} | {idle[name]:.0%} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
