"""The weight-sync group's broadcast (embodied/cluster/broadcast.py), by hand: buckets of one
dtype up to a size, entries that arrive whole and in place, and a receiver whose model differs
stopped by the header. The members are threads of this process over a gloo group."""

import datetime
import threading

import torch
import torch.distributed as dist

from embodied.cluster.broadcast import SyncGroup, buckets, connect

F32 = torch.float32


def test_buckets_are_consecutive_entries_of_one_dtype_up_to_the_size():
    named = [
        ("a", torch.zeros(4)),  # 16 bytes
        ("b", torch.zeros(2)),  # 8: a and b fit in 24
        ("c", torch.zeros(3)),  # 12: 36 > 24, a new bucket
        ("n", torch.zeros(2, dtype=torch.long)),  # another dtype, another bucket
        ("big", torch.zeros(10)),  # 40 > 24: a bucket of its own
        ("d", torch.zeros(1)),
    ]
    got = [[key for key, _ in bucket] for bucket in buckets(named, bucket_bytes=24)]
    assert got == [["a", "b"], ["c"], ["n"], ["big"], ["d"]]


def run_group(sender: list, receivers: list[list], bucket_bytes: int) -> list:
    """Rank 0 sends ``sender`` (name, tensor) pairs; rank r receives into the shapes of
    ``receivers[r - 1]``. Each member's answer (or the exception it raised)."""
    size = 1 + len(receivers)
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    answers: list = [None] * size

    def member(rank: int) -> None:
        group = None
        try:
            # (a store client each, as each worker process has)
            mine = store if rank == 0 else connect(f"127.0.0.1:{store.port}")
            group = SyncGroup(mine, rank, size, epoch=1)
            if rank == 0:
                answers[0] = group.send(sender, bucket_bytes)
            else:
                answers[rank] = group.receive(receivers[rank - 1], bucket_bytes)
        except Exception as e:  # (shown by the assertion; its frames would hold the group)
            answers[rank] = e.with_traceback(None)
        finally:
            # a member that stopped leaves the group, as its process's end would: a broadcast
            # the others wait on for it ends at once (no wait for SYNC_TIMEOUT_S)
            del group

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return answers


def test_every_entry_arrives_whole_in_every_dtype():
    torch.manual_seed(0)
    sent = [
        ("w", torch.randn(3, 5)),
        ("b", torch.randn(5)),
        ("count", torch.tensor([7, 9], dtype=torch.long)),
        ("mask", torch.tensor([True, False, True])),
        ("mean", torch.randn(4, dtype=torch.float64)),
    ]
    template = [(key, torch.zeros_like(t)) for key, t in sent]
    answers = run_group(sent, [template, template], bucket_bytes=32)
    nbytes = 15 * 4 + 5 * 4 + 2 * 8 + 3 + 4 * 8
    assert answers[0] == nbytes
    for received in answers[1:]:
        assert list(received) == [key for key, _ in sent]
        for key, tensor in sent:
            assert received[key].dtype == tensor.dtype and torch.equal(received[key], tensor)


def test_a_receiver_whose_model_differs_stops_at_the_header():
    sent = [("w", torch.ones(3, 5)), ("b", torch.ones(5))]
    other = [("w", torch.zeros(3, 5)), ("b", torch.zeros(6))]
    answers = run_group(sent, [other], bucket_bytes=1024)
    assert isinstance(answers[1], RuntimeError)
    assert "2 entries of 20 elements" in str(answers[1])
    assert "2 of 21" in str(answers[1])
    # (the sender's next broadcast, which the receiver never joins, ends when it leaves)
    assert isinstance(answers[0], RuntimeError)
