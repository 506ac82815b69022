"""The mailbox and per-link flow control in-process, without sockets: early arrivals, header-time
acknowledgements, aborts before and after an op opens, closing, and the RTS/CTS races."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest

from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb
from decentd.keys import agreement, at_node, at_worker, part
from decentd.mailbox.arrivals import Arrival, Message
from decentd.mailbox.horizons import MEMORY as HORIZON_MEMORY
from decentd.mailbox.records import Key
from decentd.mailbox.slots import Mailbox
from decentd.net.flow import CREDIT_IDLE, CREDIT_SOON, FlowError, LinkFlow, window_per_peer

OP = pb.NEIGHBOR_ALLREDUCE
F32 = pb.FLOAT32


class Outbox:
    """Records what the mailbox asks the links to send."""

    def __init__(self) -> None:
        self.acks: list[tuple[int, list[tuple[str, int]], int, bool]] = []
        self.cts: list[tuple[int, int]] = []

    def send_acks(self, dst: int, keys: list[tuple[str, int]], tag: int, arrived: bool) -> None:
        self.acks.append((dst, keys, tag, arrived))

    def send_cts(self, dst: int, message_id: int) -> None:
        self.cts.append((dst, message_id))


class Listener:
    """An open op: records aborts and stray parts."""

    def __init__(self) -> None:
        self.aborts: list[tuple[int, str]] = []
        self.strays: list[Key] = []
        self.foreign_ops: list[tuple[int, int]] = []

    def aborted(self, src: int, error: pb.Error) -> None:
        self.aborts.append((src, error.message))

    def stray(self, key: Key, arrival: Arrival) -> None:
        self.strays.append(key)

    def foreign(self, src: int, op: int) -> None:
        self.foreign_ops.append((src, op))


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def wire(name: str = "x", round_: int = 0, tag: int = 0, n: int = 4,
         dtype: int = F32, src: int = 1) -> pb.Part:
    p = part(name, round_, tag, OP, dtype, (n,), 4 * n)
    p.src = src
    return p


def arrival(p: pb.Part, src: int = 1, released: list[Message] | None = None) -> Arrival:
    """An arrival of ``p`` whose message records when it is released."""
    def on_release(msg: Message) -> None:
        if released is not None:
            released.append(msg)

    msg = Message(src, None, 1, 0, on_release)
    return Arrival(src, int(p.op), int(p.meta.dtype), tuple(p.meta.shape), 1.0,
                   np.zeros(int(p.nbytes), np.uint8), msg)


def test_an_early_arrival_waits_for_its_op_and_is_released_when_the_op_closes() -> None:
    async def body() -> None:
        box, released = Mailbox(Outbox()), list[Message]()
        box.deliver(wire(), arrival(wire(), released=released))
        assert box.early_bytes == 16
        fut = box.expect(1, "x", 0, 0)
        assert fut.done() and box.early_bytes == 0
        assert released == []  # held by the op until it ends
        box.close([("x", 0)])
        assert len(released) == 1 and box.slot_count == 0
    run(body())


def test_a_waiting_op_gets_its_part_and_other_keys_do_not_match() -> None:
    async def body() -> None:
        box = Mailbox(Outbox())
        fut = box.expect(1, "x", 0, 0)
        for other in (wire(round_=1), wire(tag=1), wire(name="y")):
            box.deliver(other, arrival(other))
        box.deliver(wire(src=2), arrival(wire(src=2), src=2))  # another sender
        assert not fut.done()
        box.deliver(wire(), arrival(wire()))
        assert fut.done() and fut.result().src == 1
    run(body())


def test_a_part_that_matches_is_acknowledged_at_its_header_and_only_once() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        box.expect(1, "x", 0, 0, accepts=(OP, F32, (4,)))
        box.header("conn", [wire()])
        assert out.acks == [(1, [("x", 0)], 0, False)]
        box.arrived("conn")
        a = arrival(wire())
        box.deliver(wire(), a)
        assert a.acked and len(out.acks) == 1  # the op need not acknowledge it again
    run(body())


def test_a_part_that_does_not_match_is_not_acknowledged_early() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        fut = box.expect(1, "x", 0, 0, accepts=(OP, F32, (4,)))
        other = wire(n=5)  # another shape: the op's checks fail it, no early ACK
        box.header("conn", [other])
        a = arrival(other)
        box.deliver(other, a)
        assert out.acks == [] and fut.result() is a and not a.acked
    run(body())


def test_an_op_that_starts_while_its_part_arrives_acknowledges_at_once() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        box.header("conn", [wire()])  # the payload is on its way
        box.expect(1, "x", 0, 0, accepts=(OP, F32, (4,)))
        assert out.acks == [(1, [("x", 0)], 0, False)]
        box.arrived("conn")
        box2 = Mailbox(out2 := Outbox())
        box2.header("conn", [wire()])
        box2.arrived("conn")  # all here before the op: acknowledged by the op, later
        box2.expect(1, "x", 0, 0, accepts=(OP, F32, (4,)))
        assert out2.acks == []
    run(body())


def test_an_abort_before_the_op_opens_is_kept_for_it_and_drops_its_data() -> None:
    async def body() -> None:
        box, released = Mailbox(Outbox()), list[Message]()
        box.deliver(wire(), arrival(wire(), released=released))
        box.aborted([wire()], pb.Error(code=pb.MISMATCH, message="bad"))
        assert len(released) == 1 and box.early_bytes == 0
        listener = Listener()
        assert [(src, e.message) for src, e in box.open([("x", 0)], listener)] == [(1, "bad")]
        box.aborted([wire(src=2)], pb.Error(code=pb.TIMEOUT, message="late"))
        assert listener.aborts == [(2, "late")]  # open: told at once
    run(body())


def test_an_abort_for_a_closed_op_is_not_kept() -> None:
    async def body() -> None:
        box = Mailbox(Outbox())
        box.open([("x", 0)], Listener())
        box.close([("x", 0)])
        box.aborted([wire()], pb.Error(code=pb.TIMEOUT, message="late"))
        assert box.open([("x", 0)], Listener()) == []
    run(body())


def test_closing_cancels_waiters_and_drops_later_arrivals() -> None:
    async def body() -> None:
        box, released = Mailbox(Outbox()), list[Message]()
        fut = box.expect(1, "x", 0, 0)
        ack = box.expect_ack(1, "x", 0, 0)
        box.close([("x", 0)])
        assert fut.cancelled() and ack.cancelled()
        box.deliver(wire(), arrival(wire(), released=released))
        assert len(released) == 1 and box.early_bytes == 0 and box.slot_count == 0
    run(body())


def test_a_part_for_an_open_op_that_nobody_waits_for_is_reported_as_stray() -> None:
    async def body() -> None:
        box, listener = Mailbox(Outbox()), Listener()
        box.open([("x", 0)], listener)
        box.deliver(wire(tag=7), arrival(wire(tag=7)))
        assert listener.strays == [(1, "x", 0, 7)]
    run(body())


def test_acks_resolve_only_the_parts_they_name() -> None:
    async def body() -> None:
        box = Mailbox(Outbox())
        mine, other = box.expect_ack(1, "x", 0, 0), box.expect_ack(1, "y", 0, 0)
        box.acked([pb.Part(name="x", round=0, tag=0, src=1)])
        assert mine.done() and not other.done()
    run(body())


def test_a_lost_peer_fails_only_what_waits_on_it() -> None:
    async def body() -> None:
        box = Mailbox(Outbox())
        theirs, ours = box.expect(1, "x", 0, 0), box.expect(2, "x", 0, 0)
        ack = box.expect_ack(1, "y", 0, 0)
        box.peer_lost(1, lambda key: key[0] == 1, ConnectionError("gone"))
        assert isinstance(theirs.exception(), ConnectionError)
        assert isinstance(ack.exception(), ConnectionError)
        assert not ours.done()
    run(body())


def test_a_large_message_is_cleared_to_send_when_its_op_waits() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        header = pb.BulkHeader(kind=pb.RTS, message_id=5, parts=[wire()])
        box.announce(1, 5, header)
        assert out.cts == []  # nothing here takes it yet: it stays with the sender
        with pytest.raises(ValueError, match="not cleared to send"):
            box.announced.payload_parts((1, 5))
        box.expect(1, "x", 0, 0)
        assert out.cts == [(1, 5)]
        assert [p.name for p in box.announced.payload_parts((1, 5)) or []] == ["x"]
        done = box.announced.payload_done
        assert done((1, 5)) is not None and done((1, 5)) is None
    run(body())


def test_a_large_message_for_an_open_op_is_cleared_at_once() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        box.open([("x", 0)], Listener())
        box.announce(1, 5, pb.BulkHeader(kind=pb.RTS, message_id=5, parts=[wire()]))
        assert out.cts == [(1, 5)]
    run(body())


def test_a_cleared_payload_whose_op_ended_is_read_and_dropped() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        box.expect(1, "x", 0, 0)
        box.announce(1, 5, pb.BulkHeader(kind=pb.RTS, message_id=5, parts=[wire()]))
        box.close([("x", 0)])  # the op timed out before the payload came
        assert box.announced.payload_parts((1, 5)) is None  # dropped, not a protocol error
        assert box.announced.payload_done((1, 5)) is None


    run(body())


def test_an_announcement_after_its_op_ended_is_ignored() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        box.open([("x", 0)], Listener())
        box.close([("x", 0)])
        box.announce(1, 5, pb.BulkHeader(kind=pb.RTS, message_id=5, parts=[wire()]))
        box.expect(1, "x", 0, 0)  # even a new waiter for the key does not clear it
        assert out.cts == []
    run(body())


def test_a_message_is_dropped_only_when_all_its_ops_ended() -> None:
    async def body() -> None:
        out = Outbox()
        box = Mailbox(out)
        header = pb.BulkHeader(kind=pb.RTS, message_id=5, parts=[wire("x"), wire("y")])
        box.expect(1, "x", 0, 0)
        box.expect(1, "y", 0, 0)
        box.announce(1, 5, header)
        box.close([("x", 0)])
        parts = box.announced.payload_parts((1, 5)) or []
        assert [p.name for p in parts] == ["x", "y"]  # y still wants it
        box.close([("y", 0)])
        assert box.announced.payload_parts((1, 5)) is None
    run(body())


def test_a_landing_payload_is_moved_away_when_its_op_closes() -> None:
    async def body() -> None:
        box = Mailbox(Outbox())
        into = np.zeros(16, np.uint8)
        box.expect(1, "x", 0, 0, into=(into, (OP, F32, (4,))))
        assert box.landing_target(wire(n=5), 20) is None  # not what the op takes
        assert box.landing_target(wire(), 16) is into

        class Landing:
            cancelled = False

            def cancel(self) -> None:
                self.cancelled = True

        landing = Landing()
        box.landing(wire(), landing)
        box.close([("x", 0)])
        assert landing.cancelled
    run(body())


def test_forgetting_history_lets_a_new_job_reuse_keys() -> None:
    async def body() -> None:
        box, released = Mailbox(Outbox()), list[Message]()
        box.open([("x", 0)], Listener())
        box.close([("x", 0)])
        box.deliver(wire("y"), arrival(wire("y"), released=released))
        box.forget_history()
        assert released and box.early_bytes == 0 and not box.closed(("x", 0))
        fut = box.expect(1, "x", 0, 0)
        box.deliver(wire(), arrival(wire()))
        assert fut.done()  # round 0 of "x" is a new op again
    run(body())


def test_a_message_is_released_with_its_last_part() -> None:
    released: list[Message] = []
    msg = Message(1, None, 2, 0, released.append)
    parts = [Arrival(1, OP, F32, (1,), 1.0, np.zeros(4, np.uint8), msg) for _ in range(2)]
    parts[0].release()
    parts[0].release()  # idempotent
    assert released == []
    parts[1].release()
    assert released == [msg]


# ---------------------------------------------------------------------- flow control


def test_eager_sends_spend_credit_and_a_skipped_frame_refunds_it() -> None:
    flow = LinkFlow(window=100, credits=100)
    assert flow.take(60) and not flow.take(50)  # 40 left: the next goes as RTS
    flow.refund(60, 7)
    assert flow.credits == 100 and flow.owed == 7
    flow.returned(10)
    assert flow.credits == 110


def test_a_peer_past_its_window_breaks_the_contract() -> None:
    flow = LinkFlow(window=100)
    flow.accept_eager(60, peer=1)
    with pytest.raises(FlowError, match="rank 1 sent 50 eager bytes with 60 of its 100-byte"):
        flow.accept_eager(50, peer=1)
    assert flow.consumed(60) == CREDIT_SOON  # a flush is scheduled
    flow.accept_eager(100, peer=1)  # the window is free again


def test_owed_credit_rides_on_the_next_frame_once() -> None:
    flow = LinkFlow(window=100)
    flow.accept_eager(30, peer=1)
    assert flow.consumed(30) == CREDIT_SOON and flow.consumed(0) is None  # one at a time
    header = pb.BulkHeader(kind=pb.ACK)
    assert framing.decode(pb.BulkHeader, flow.stamp(header)[framing.LENGTH:]).credit == 30
    assert flow.owed == 0 and not flow.flush_due()  # nothing left for the flush to carry
    assert framing.decode(pb.BulkHeader,
                          flow.stamp(pb.BulkHeader(kind=pb.ACK))[framing.LENGTH:]).credit == 0


def test_a_little_owed_credit_waits_for_a_frame_and_a_quarter_of_the_window_goes_soon() -> None:
    flow = LinkFlow(window=100)
    flow.accept_eager(60, peer=1)
    assert flow.consumed(10) == CREDIT_IDLE  # the peer has plenty: a frame will carry it
    assert flow.consumed(10) is None  # that flush is pending
    assert flow.consumed(5) == CREDIT_SOON  # 25 owed: a quarter of the window, sooner
    assert flow.consumed(5) is None
    assert flow.flush_due()  # the soon one: nothing carried the 30 meanwhile
    assert framing.decode(pb.BulkHeader, flow.stamp(pb.BulkHeader(kind=pb.ACK))
                          [framing.LENGTH:]).credit == 30
    assert not flow.flush_due()  # the idle one finds nothing left


def test_each_peer_gets_a_share_of_the_early_budget_but_at_least_a_mebibyte() -> None:
    assert window_per_peer(8 << 20, 4) == 2 << 20
    assert window_per_peer(1 << 20, 7) == 1 << 20
    assert window_per_peer(1 << 30, 0) == 1 << 30


def test_a_lost_link_fails_every_message_waiting_for_its_cts() -> None:
    async def body() -> None:
        from decentd.net.flow import Rendezvous

        flow = LinkFlow(window=100)
        done = asyncio.get_running_loop().create_future()
        flow.rendezvous[1] = Rendezvous([], "x", done)
        flow.fail_rendezvous(ConnectionError("gone"))
        assert isinstance(done.exception(), ConnectionError) and not flow.rendezvous
    run(body())


def test_parts_and_aborts_under_another_key_of_the_same_name_reach_the_open_op() -> None:
    # a worker's op "j\x1fx" and a node-level op or an agreement of the same name meet nowhere
    # else: what comes for one while the other is open (or before it opens) is told to it, so
    # that two ops of different kinds under one name fail as a mismatch instead of timing out
    mine, node = at_worker("j\x1fx", 0), at_node("j\x1fx")

    async def body() -> None:
        box, listener = Mailbox(Outbox()), Listener()
        box.deliver(wire(node), arrival(wire(node), src=1))  # before the op opens
        box.open([(mine, 0)], listener)
        assert listener.foreign_ops == [(1, OP)]
        box.deliver(wire(node, src=2), arrival(wire(node, src=2), src=2))  # while it is open
        assert listener.foreign_ops == [(1, OP), (2, OP)]
        agreeing = wire(agreement(node))
        agreeing.op = pb.AGREEMENT
        box.deliver(agreeing, arrival(agreeing))  # an agreement's part: not an op's data
        box.deliver(wire("j\x1fy\x1en"), arrival(wire("j\x1fy\x1en")))  # another name
        box.deliver(wire(node, round_=1), arrival(wire(node, round_=1)))  # another round
        assert len(listener.foreign_ops) == 2
        box.aborted([wire(agreement(node), src=3)], pb.Error(code=pb.MISMATCH, message="no"))
        assert listener.aborts == [(3, "no")]
        box.close([(mine, 0)])  # its name is forgotten with it
        later = Listener()
        box.open([(at_worker("j\x1fx", 1), 0)], later)
        assert later.foreign_ops == []
    run(body())


def test_a_peers_horizon_fails_its_waits_at_or_below_it_now_and_later_and_no_others() -> None:
    # RAN_WITHOUT(key, 5) from worker 1: it ran rounds 0..5 of our key without us
    mine = at_worker("j\x1fx", 0)

    async def body() -> None:
        box = Mailbox(Outbox())
        at4, at6 = box.expect(1, mine, 4, 0), box.expect(1, mine, 6, 0)
        other_peer, ack = box.expect(2, mine, 4, 0), box.expect_ack(1, mine, 5, 0)
        told = wire(mine, round_=5)
        box.ran_without([told], lambda p: ConnectionError(f"ran {p.round} without us"))
        assert str(at4.exception()) == "ran 5 without us"
        assert isinstance(ack.exception(), ConnectionError)
        assert not at6.done() and not other_peer.done()
        assert isinstance(box.expect(1, mine, 5, 0).exception(), ConnectionError)  # later
        assert not box.expect(1, mine, 6, 1).done()
        box.restarted(0, "j")  # our worker counts from 0 again: the horizon says nothing now
        assert not box.expect(1, mine, 3, 0).done()
    run(body())


def test_the_rounds_started_and_the_horizons_held_are_bounded_by_key() -> None:
    # an authenticated peer flooding RAN_WITHOUT, or a job using a fresh name per op, keeps
    # the last keys (horizons.MEMORY), not all of them
    async def body() -> None:
        box = Mailbox(Outbox())
        for r in range(3):
            box.open([(at_worker("j\x1fx", 0), r)], Listener())
        assert box.started.last() == [(at_worker("j\x1fx", 0), 2)]
        for i in range(HORIZON_MEMORY + 10):
            box.open([(at_worker(f"j\x1fn{i}", 0), 0)], Listener())
        flood = [wire(at_worker(f"j\x1fn{i}", 0), round_=7) for i in range(HORIZON_MEMORY + 10)]
        box.ran_without(flood, lambda p: ConnectionError("apart"))
        assert len(box.started.last()) == HORIZON_MEMORY
        assert not box.expect(1, at_worker("j\x1fn0", 0), 1, 0).done()  # forgotten: waits
        assert box.expect(1, at_worker(f"j\x1fn{HORIZON_MEMORY}", 0), 1, 0).done()
    run(body())
