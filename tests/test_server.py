"""The policy server on loopback: handshake, health, concurrency, bad input, disconnects, floods."""

import json
import threading
import time
import urllib.request

import numpy as np
import pytest
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
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5).read()
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
    [t.join(20) for t in threads]
    assert not errors and answers == {i: [0.0, 2.0, 4.0, 6.0, 8.0] for i in range(8)}


def test_malformed_and_oversized_requests_get_error_replies_and_service_goes_on(server):
    with connect(url(server)) as ws:
        ws.send(pack({"type": "hello", "contract": CONTRACT}))
        assert unpack(ws.recv(timeout=5))["type"] == "hello"
        ws.send(b"\x00\xffnot msgpack")
        assert "malformed" in unpack(ws.recv(timeout=5))["error"]
        ws.send(pack({"type": "infer"}))  # no observation
        assert "malformed" in unpack(ws.recv(timeout=5))["error"]
        ws.send("a text frame")
        assert "refused" in unpack(ws.recv(timeout=5))["error"]
        ws.send(
            pack({"type": "infer", "obs": {"state": np.zeros(2000, np.float32)}})
        )  # 8 KB > 4 KB
        assert "refused" in unpack(ws.recv(timeout=5))["error"]
        ws.send(pack({"type": "infer", "id": 7, "obs": {"state": np.ones(2, np.float32)}}))
        reply = unpack(ws.recv(timeout=5))
        assert reply["type"] == "chunk" and reply["id"] == 7  # the same connection still served
    assert server.stats["errors"] == 4


def test_a_client_that_disconnects_mid_request_does_not_hurt_others():
    def slow(obs):
        time.sleep(0.3)
        return doubling(obs)

    s = PolicyServer(slow, CONTRACT, port=0).start()
    try:
        ws = connect(url(s))
        ws.send(pack({"type": "hello", "contract": CONTRACT}))
        ws.recv(timeout=5)
        ws.send(pack({"type": "infer", "id": 1, "obs": {"state": np.ones(2, np.float32)}}))
        ws.close()  # gone before the answer
        client = PolicyClient(url(s), CONTRACT, timeout_s=5)
        np.testing.assert_array_equal(
            client.infer({"state": np.array([3.0, 4.0], np.float32)})[0], [6.0, 8.0]
        )
        client.close()
    finally:
        s.stop()


def test_a_flood_is_shed_with_busy_replies_not_queued_without_bound():
    def slow(obs):
        time.sleep(0.05)
        return doubling(obs)

    s = PolicyServer(slow, CONTRACT, port=0, queue_size=2).start()
    try:
        replies = []

        def flood(n):
            with connect(url(s)) as ws:
                ws.send(pack({"type": "hello", "contract": CONTRACT}))
                ws.recv(timeout=5)
                for k in range(
                    n
                ):  # sent without waiting; one connection's are answered in order...
                    ws.send(
                        pack({"type": "infer", "id": k, "obs": {"state": np.ones(2, np.float32)}})
                    )
                for _ in range(n):
                    replies.append(unpack(ws.recv(timeout=10)))

        threads = [
            threading.Thread(target=flood, args=(10,)) for _ in range(6)
        ]  # ...60 in flight at once
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        kinds = [r["type"] if r["type"] == "chunk" else r["error"] for r in replies]
        assert len(replies) == 60 and kinds.count("busy") > 0 and kinds.count("chunk") > 0
        assert s.stats["busy"] == kinds.count("busy")
    finally:
        s.stop()
