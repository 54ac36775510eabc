"""The policy server on loopback: handshake, health, concurrency, bad input, disconnects, floods.

Where a test needs a request to be in flight, the model blocks on an event the test sets, never
on a sleep: what is queued, refused or answered is then the same on any machine."""

import json
import threading
import urllib.request

import numpy as np
import pytest
from clocks import CEILING_S, wait_until
from websockets.sync.client import connect

from embodied.robots.server import PolicyClient, PolicyServer, pack, unpack

CONTRACT = {
    "action": {"space": "joint_pos", "names": ["a", "b"]},
    "state_names": ["a.pos", "b.pos"],
    "cameras": [],
    "normalization": "v1",
}


def doubling(obs):  # a chunk of 3 actions that shows which request it answers
    return np.repeat(np.asarray(obs["state"], np.float32)[None] * 2, 3, 0)


def gated(gate: threading.Event, started: threading.Event | None = None):
    """``doubling`` that waits until ``gate`` is set (a model busy until the test says); it sets
    ``started`` when it takes a request."""

    def infer(obs):
        if started is not None:
            started.set()
        assert gate.wait(CEILING_S), "the test never opened the gate"
        return doubling(obs)

    return infer


@pytest.fixture
def server():
    s = PolicyServer(
        doubling, CONTRACT, port=0, queue_size=8, max_bytes=4096
    ).start()  # one request in flight per client
    yield s
    s.stop()


def url(s):
    return f"ws://127.0.0.1:{s.port}"


def test_handshake_inference_timing_and_health(server):
    client = PolicyClient(url(server), CONTRACT)
    try:
        out = client.infer(
            {"state": np.array([1.0, -2.0], np.float32), "images": {}, "instruction": "x"}
        )
        np.testing.assert_array_equal(out, [[2.0, -4.0]] * 3)
        assert out.dtype == np.float32 and set(client.last_timing) == {"queue_ms", "infer_ms"}
        health = json.loads(
            urllib.request.urlopen(
                f"http://127.0.0.1:{server.port}/health", timeout=CEILING_S
            ).read()
        )
        assert health["ok"] and health["contract"] == CONTRACT and health["clients"] == 1
    finally:
        client.close()


def test_a_mismatched_contract_is_refused(server):
    other = {**CONTRACT, "normalization": "v2"}
    with pytest.raises(ConnectionRefusedError, match=r"contract mismatch in \['normalization'\]"):
        PolicyClient(url(server), other)


def test_eight_concurrent_clients_each_get_their_own_answers(server):
    errors, answers = [], {}

    def run(i):
        try:
            c = PolicyClient(url(server), CONTRACT)
            answers[i] = [
                float(c.infer({"state": np.array([i, k], np.float32)})[0, 1]) for k in range(5)
            ]
            c.close()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(CEILING_S) for t in threads]
    assert not errors and answers == {i: [0.0, 2.0, 4.0, 6.0, 8.0] for i in range(8)}


def test_malformed_and_oversized_requests_get_error_replies_and_service_goes_on(server):
    with connect(url(server)) as ws:
        ws.send(pack({"type": "hello", "contract": CONTRACT}))
        assert unpack(ws.recv(timeout=CEILING_S))["type"] == "hello"
        ws.send(b"\x00\xffnot msgpack")
        assert "malformed" in unpack(ws.recv(timeout=CEILING_S))["error"]
        ws.send(pack({"type": "infer"}))  # no observation
        assert "malformed" in unpack(ws.recv(timeout=CEILING_S))["error"]
        ws.send("a text frame")
        assert "refused" in unpack(ws.recv(timeout=CEILING_S))["error"]
        ws.send(
            pack({"type": "infer", "obs": {"state": np.zeros(2000, np.float32)}})
        )  # 8 KB > 4 KB
        assert "refused" in unpack(ws.recv(timeout=CEILING_S))["error"]
        ws.send(pack({"type": "infer", "id": 7, "obs": {"state": np.ones(2, np.float32)}}))
        reply = unpack(ws.recv(timeout=CEILING_S))
        assert reply["type"] == "chunk" and reply["id"] == 7  # the same connection still served
    assert server.stats["errors"] == 4


def test_a_client_that_disconnects_mid_request_does_not_hurt_others():
    gate = threading.Event()
    s = PolicyServer(gated(gate), CONTRACT, port=0).start()
    try:
        ws = connect(url(s))
        ws.send(pack({"type": "hello", "contract": CONTRACT}))
        ws.recv(timeout=CEILING_S)
        ws.send(pack({"type": "infer", "id": 1, "obs": {"state": np.ones(2, np.float32)}}))
        wait_until(lambda: s.stats["requests"] == 1, "the first request at the server")
        ws.close()  # gone before the answer: the model is still on its request
        client = PolicyClient(url(s), CONTRACT, timeout_s=CEILING_S)
        wait_until(lambda: s.stats["clients"] == 2, "the second client's handshake")
        gate.set()  # the first answer goes to a closed connection, the second to the client
        np.testing.assert_array_equal(
            client.infer({"state": np.array([3.0, 4.0], np.float32)})[0], [6.0, 8.0]
        )
        client.close()
        assert s.stats["errors"] == 0 and s.stats["requests"] == 2
    finally:
        gate.set()
        s.stop()


def test_a_flood_is_shed_with_busy_replies_not_queued_without_bound():
    """One request holds the model; then 6 connections send 10 requests each without waiting (a
    connection's requests are answered in order, one at a time). The first 2 to arrive fill the
    queue; the other 4 get "busy" for all 10 of theirs at once. Then the model goes on, and the 2
    held connections never find the queue full again (1 in the model + 2 queued at most)."""
    gate = threading.Event()
    started = threading.Event()
    s = PolicyServer(gated(gate, started), CONTRACT, port=0, queue_size=2).start()
    replies = {}

    def flood(c: int, n: int) -> None:
        with connect(url(s)) as ws:
            ws.send(pack({"type": "hello", "contract": CONTRACT}))
            ws.recv(timeout=CEILING_S)
            for k in range(n):
                ws.send(pack({"type": "infer", "id": k, "obs": {"state": np.ones(2, np.float32)}}))
            replies[c] = [unpack(ws.recv(timeout=CEILING_S)) for _ in range(n)]

    first = threading.Thread(target=flood, args=("first", 1))
    threads = [threading.Thread(target=flood, args=(c, 10)) for c in range(6)]
    try:
        first.start()
        assert started.wait(CEILING_S)  # the model holds the first request: the queue is empty
        [t.start() for t in threads]
        wait_until(lambda: s.stats["busy"] == 40, "40 busy replies while the model is held")
        gate.set()
        [t.join(CEILING_S) for t in [first, *threads]]
    finally:
        gate.set()
        s.stop()
    kinds = {c: [r.get("error", r["type"]) for r in got] for c, got in replies.items()}
    assert kinds.pop("first") == ["chunk"]
    assert sorted(kinds.values()) == [["busy"] * 10] * 4 + [["chunk"] * 10] * 2
    served = [got for got in replies.values() if got[0]["type"] == "chunk"]
    assert all([r["id"] for r in got] == list(range(len(got))) for got in served)  # in order
    assert s.stats["busy"] == 40 and s.stats["requests"] == 61


def test_a_reply_that_comes_after_its_timeout_is_dropped_not_taken_for_the_next():
    """The first request times out while the model is busy; its reply comes after all, ahead of
    the second's. The client drops it and answers the second request with the second's chunk."""
    gate = threading.Event()
    started = threading.Event()
    s = PolicyServer(gated(gate, started), CONTRACT, port=0).start()
    client = PolicyClient(url(s), CONTRACT, timeout_s=CEILING_S)
    try:
        client.timeout_s = 0.0  # the first reply cannot be there yet: the gate is shut
        first = {"state": np.array([1.0, 1.0], np.float32), "images": {}, "instruction": "x"}
        with pytest.raises(TimeoutError):
            client.infer(first)
        assert started.wait(CEILING_S)
        gate.set()
        client.timeout_s = CEILING_S
        second = {"state": np.array([3.0, -1.0], np.float32), "images": {}, "instruction": "x"}
        np.testing.assert_array_equal(client.infer(second), [[6.0, -2.0]] * 3)
        third = {"state": np.array([0.5, 2.0], np.float32), "images": {}, "instruction": "x"}
        np.testing.assert_array_equal(client.infer(third), [[1.0, 4.0]] * 3)
    finally:
        client.close()
        s.stop()


class CountingLock:
    """A lock that counts the calls that asked for it (a spy on the client's lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.asked = 0

    def __enter__(self):
        self.asked += 1
        self.lock.acquire()

    def __exit__(self, *exc_info):
        self.lock.release()


def test_two_threads_on_one_client_take_turns_and_each_gets_its_own_chunk():
    """An episode's executor thread may still wait on its reply when the next episode's asks:
    the client sends one request at a time (two waits on one connection raised websockets'
    ConcurrencyError)."""
    gate = threading.Event()
    started = threading.Event()
    s = PolicyServer(gated(gate, started), CONTRACT, port=0).start()
    client = PolicyClient(url(s), CONTRACT, timeout_s=CEILING_S)
    client._lock = CountingLock()
    answers, errors = {}, []

    def ask(value: float) -> None:
        obs = {"state": np.array([value, value], np.float32), "images": {}, "instruction": "x"}
        try:
            answers[value] = client.infer(obs)
        except Exception as e:
            errors.append(e)

    first = threading.Thread(target=ask, args=(1.0,))
    second = threading.Thread(target=ask, args=(2.0,))
    try:
        first.start()
        assert started.wait(CEILING_S)  # the first request is with the model, its reply held
        second.start()
        # the second call is in ``infer`` while the first waits on its reply (without the lock
        # the two would wait on the connection at once: one fails, and the wait ends)
        wait_until(
            lambda: client._lock.asked == 2,
            "the second call at the client's lock",
            gone=lambda: bool(errors),
        )
        gate.set()
        first.join(CEILING_S)
        second.join(CEILING_S)
        assert errors == []
        np.testing.assert_array_equal(answers[1.0], [[2.0, 2.0]] * 3)
        np.testing.assert_array_equal(answers[2.0], [[4.0, 4.0]] * 3)
    finally:
        gate.set()
        client.close()
        s.stop()


def test_a_request_waits_as_long_as_it_is_given():
    """A request's own timeout (a deploy's warm-up: a cold server's first call), not the
    client's; the late reply to it is dropped and the next request answered."""
    gate = threading.Event()
    s = PolicyServer(gated(gate), CONTRACT, port=0).start()
    try:
        client = PolicyClient(url(s), CONTRACT, timeout_s=CEILING_S)
        obs = {"state": np.array([3.0, 4.0], np.float32)}
        with pytest.raises(TimeoutError):
            client.infer(obs, timeout_s=0.05)  # (the model holds it until the gate opens)
        gate.set()
        np.testing.assert_array_equal(client.infer(obs)[0], [6.0, 8.0])
        client.close()
    finally:
        gate.set()
        s.stop()
