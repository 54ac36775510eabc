"""The direct data plane between env workers and a rollout worker (embodied/cluster/direct.py), in
one process: members are threads here, each with its own connection, as env workers have."""

import select
import socket
import threading
from multiprocessing import AuthenticationError

import pytest
import torch
from clocks import CEILING_S, wait_until
from scripted_envs import ScriptedPolicy

from embodied.cluster import direct
from embodied.inference import InferencePolicy
from embodied.schema import Observation


def observation(rows: list[int], t: float = 0.0) -> Observation:
    """The scripted env's state for env indices ``rows``: [t, b, 0] (the policy acts with b)."""
    state = torch.tensor([[t, float(b), 0.0] for b in rows])  # f32 [n, 3]
    return Observation(state=state, instruction=["push"] * len(rows))


def connected(members: int):
    """A listener and ``members`` connections to it made at once (threads), in member order on
    both sides."""
    listener, address, key = direct.listen("127.0.0.1")
    made = [None] * members

    def member(m: int) -> None:
        made[m] = direct.connect(address, key, m)

    threads = [threading.Thread(target=member, args=(m,)) for m in range(members)]
    for thread in threads:
        thread.start()
    served = direct.accept(listener, key, members, timeout_s=60)
    for thread in threads:
        thread.join()
    return listener, served, made


def test_sixteen_members_connecting_at_once_are_all_accepted_in_member_order():
    """(A listener's default backlog, 1, loses connections made at once: a member then waits
    for its handshake forever.)"""
    listener, served, made = connected(16)
    for m, connection in enumerate(made):
        connection.send(m)
    assert [c.recv() for c in served] == list(range(16))
    listener.close()


def test_a_member_that_never_connects_ends_the_wait_with_not_connected():
    """An env worker lost before it connected: the rollout worker stops waiting at the deadline
    (its next call, the recovery's, could not run otherwise)."""
    listener, address, key = direct.listen("127.0.0.1")
    made = []
    thread = threading.Thread(target=lambda: made.append(direct.connect(address, key, 0)))
    thread.start()
    # member 0's connection waits in the backlog before the deadline starts: accepted at once
    # however late its thread ran (the 0.2 s is member 1's, which never comes)
    wait_until(lambda: select.select([listener], [], [], 0)[0], "member 0's connection")
    with pytest.raises(direct.NotConnected) as raised:
        direct.accept(listener, key, 2, timeout_s=0.2)
    thread.join(CEILING_S)
    assert not thread.is_alive(), "member 0 still waits for its handshake"
    assert str(raised.value) == (
        "1 of 2 env workers connected within 0.2 s (cluster.connect_timeout_s)"
    )
    made[0].close()
    listener.close()


def test_a_connection_without_the_key_is_refused_and_the_members_still_accepted():
    listener, address, key = direct.listen("127.0.0.1")
    refused = []
    made = []

    def intruder_then_member() -> None:
        with pytest.raises(AuthenticationError):
            direct.connect(address, b"not the key", 0)
        refused.append(True)
        made.append(direct.connect(address, key, 0))

    thread = threading.Thread(target=intruder_then_member)
    thread.start()
    served = direct.accept(listener, key, 1, timeout_s=60)
    thread.join()
    assert refused == [True]
    made[0].send("hello")
    assert served[0].recv() == "hello"
    listener.close()


def test_both_ends_keep_the_connection_alive_with_tcp_probes():
    """A peer on a lost node (no FIN, no RST) is found by keepalive probes: idle 10 s, then 3
    probes 5 s apart, on both ends."""
    listener, served, made = connected(1)
    for connection in (served[0], made[0]):
        with socket.fromfd(connection.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            options = (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)
            got = tuple(sock.getsockopt(socket.IPPROTO_TCP, o) for o in options)
            assert got == direct.KEEPALIVE == (10, 5, 3)
    listener.close()


def serve_members(served: list, inference: InferencePolicy, member) -> int:
    """``direct.serve`` of the connections ``served`` while ``member(m)`` runs each member in a
    thread of its own -> the act requests served."""
    threads = [threading.Thread(target=member, args=(m,)) for m in range(len(served))]
    for thread in threads:
        thread.start()
    served_acts, _ = direct.serve(served, inference)
    for thread in threads:
        thread.join()
    return served_acts


def test_lockstep_serving_answers_each_member_its_rows_of_one_act():
    """Two members of 2 and 3 rows: each act is one policy call over the 5 rows joined, in
    member order; a value request in between is answered at once; the round ends when both
    say so."""
    listener, served, made = connected(2)
    policy = ScriptedPolicy(chunk_size=2)
    inference = InferencePolicy(policy, version=7)
    rows = [[0, 1], [2, 3, 4]]
    answers: dict[int, list] = {0: [], 1: []}

    def member(m: int) -> None:
        mine = direct.DirectInference(made[m], torch.device("cpu"), has_critic=True)
        for t in range(3):
            answers[m].append(mine.act(observation(rows[m], t)))
            if m == 1 and t == 1:  # (only this member asks: values are not in lockstep)
                answers[m].append(mine.value(observation(rows[m], 4.0)))
        answers[m].append(mine.version)
        mine.end_round()

    served_acts = serve_members(served, inference, member)
    assert served_acts == 3 and policy.calls == 3  # one call per lockstep act, not per member
    for m in range(2):
        acts = [a for a in answers[m] if not isinstance(a, (torch.Tensor, int))]
        for t, out in enumerate(acts):
            # the scripted policy acts with each row's env index: every member got its own rows
            expected = torch.tensor(rows[m], dtype=torch.float32)[:, None, None].expand(-1, 2, 1)
            assert torch.equal(out.actions, expected)
            assert torch.equal(out.value, torch.full((len(rows[m]),), 0.5 * t + 0.25))
        assert answers[m][-1] == 7  # the weights' version travels with every answer
    assert torch.equal(answers[1][2], torch.full((3,), 0.5 * 4.0 + 0.25))
    listener.close()


def test_in_an_evaluation_a_member_ends_when_its_episodes_do_and_the_others_go_on():
    """Deterministic acts draw nothing: member 0 ends after one act, member 1 acts three
    times; its last two acts are policy calls over its own rows only."""
    listener, served, made = connected(2)
    policy = ScriptedPolicy(chunk_size=1)
    inference = InferencePolicy(policy)
    rows = [[0, 1], [2, 3, 4]]
    acts = {0: 1, 1: 3}
    answers: dict[int, list] = {0: [], 1: []}

    def member(m: int) -> None:
        mine = direct.DirectInference(made[m], torch.device("cpu"), has_critic=True)
        for t in range(acts[m]):
            answers[m].append(mine.act(observation(rows[m], t), deterministic=True))
        mine.end_round()

    served_acts = serve_members(served, inference, member)
    assert served_acts == 3 and policy.calls == 3
    for m in range(2):
        assert len(answers[m]) == acts[m]
        for out in answers[m]:
            expected = torch.tensor(rows[m], dtype=torch.float32)[:, None, None]
            assert torch.equal(out.actions, expected)
    listener.close()


def test_a_member_that_leaves_or_falls_out_of_step_ends_the_round_with_one_error():
    listener, served, made = connected(2)
    inference = InferencePolicy(ScriptedPolicy())
    made[0].send((direct.ACT, None, False))
    made[1].close()  # (a member lost midway)
    with pytest.raises(ConnectionError, match="env worker 1 of this rollout worker left"):
        direct.serve(served, inference)
    listener.close()
    listener, served, made = connected(2)
    made[0].send((direct.END,))
    made[1].send((direct.ACT, None, False))
    with pytest.raises(direct.OutOfStep, match="out of step"):
        direct.serve(served, inference)
    listener.close()


def test_members_are_split_among_rollout_workers_contiguously():
    assert direct.members_of(1, 3) == [range(0, 3)]
    assert direct.members_of(2, 3) == [range(0, 1), range(1, 3)]
    assert direct.members_of(2, 4) == [range(0, 2), range(2, 4)]
    assert direct.members_of(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
