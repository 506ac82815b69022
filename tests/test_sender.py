"""The bulk sender in-process, on a socket pair: frames queued for a peer while it is busy go
out together (several frames per write), whole and in order; and the loopback link hands a
daemon's frames to its own parser without a socket."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import numpy as np

from decent_wire import framing
from decent_wire.v1 import decent_pb2 as pb
from decentd.net.inbound import Inbound
from decentd.net.loopback import LoopbackSender
from decentd.net.outbound import Sender


def _read_all(sock: socket.socket, nbytes: int, started: threading.Event) -> bytes:
    started.wait()
    chunks, got = [], 0
    while got < nbytes:
        chunk = sock.recv(1 << 20)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def test_frames_queued_behind_a_busy_write_go_out_in_one_write() -> None:
    async def body() -> None:
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        loop = asyncio.get_running_loop()
        sender = Sender(ours, loop, peer=1)
        big = bytes(8 << 20)  # far more than the socket takes while nobody reads
        small = [bytes([i]) * 1000 for i in range(1, 4)]
        done: list[asyncio.Future[None]] = [loop.create_future() for _ in range(4)]

        def settle(i: int) -> Callable[[BaseException | None], None]:
            def on_done(err: BaseException | None) -> None:
                if err is None:
                    done[i].set_result(None)
                else:
                    done[i].set_exception(err)
            return on_done

        first = sender.send([big], settle(0))
        queued = [sender.send([s], settle(i + 1)) for i, s in enumerate(small)]
        assert first is not None and all(q is not None for q in queued)
        reading = threading.Event()
        total = len(big) + sum(len(s) for s in small)
        reader = loop.run_in_executor(None, _read_all, theirs, total, reading)
        reading.set()
        await asyncio.gather(*done)
        data = await reader
        assert data == big + b"".join(small)  # whole frames, in order
        writes = {q.write for q in queued if q is not None}
        assert len(writes) == 1 and first.write <= min(writes)  # the three in one write
        assert sender.frames == 4 and sender.writes < sender.frames + len(big) // (1 << 20)
        sender.close()
        theirs.close()

    asyncio.run(body())


class Sink:
    """Records what an :class:`Inbound` delivers."""

    def __init__(self) -> None:
        self.frames: list[tuple[pb.BulkHeader, bytes]] = []

    def on_header(self, conn: Inbound, header: pb.BulkHeader) -> np.ndarray | None:
        return np.empty(int(header.payload_bytes), np.uint8)

    def on_frame(self, conn: Inbound, header: pb.BulkHeader, payload: np.ndarray | None) -> None:
        self.frames.append((header, b"" if payload is None else payload.tobytes()))

    def on_progress(self, conn: Inbound, header: pb.BulkHeader, dest: np.ndarray,
                    filled: int) -> None:
        """Not needed here."""

    def on_lost(self, conn: Inbound, reason: str) -> None:
        raise AssertionError(reason)


def test_the_loopback_link_delivers_frames_in_order_on_the_event_loop() -> None:
    async def body() -> None:
        sink = Sink()
        sender = LoopbackSender(sink, rank=3, cluster_id="c")
        payload = np.arange(100_000, dtype=np.uint8)
        header = pb.BulkHeader(kind=pb.DATA, message_id=7, payload_bytes=payload.nbytes)
        done = asyncio.get_running_loop().create_future()
        sender.send([framing.encode(header), payload.data],
                    lambda err: done.set_result(err))
        assert not sink.frames  # nothing happens inside send(): it is delivered on the loop
        assert await done is None
        hello, data = sink.frames
        assert hello[0].kind == pb.HELLO and hello[0].from_rank == 3
        assert data[0].message_id == 7 and data[1] == payload.tobytes()
        skipped = sender.send([framing.encode(header), payload.data])
        assert sender.abandon(skipped) is False  # not delivered yet: skipped
        await asyncio.sleep(0)
        assert len(sink.frames) == 2 and sender.bytes_sent > payload.nbytes

    asyncio.run(body())


def test_closing_one_link_gives_up_only_its_own_wait_for_an_input_being_copied() -> None:
    # one input going to two peers, each sender thread waiting for bytes not copied yet: the
    # link to the first is closed, so its wait ends; the other's goes on and gets its bytes
    from decentd.workers.staging import FillGate, FillState

    async def main() -> tuple[str, int]:
        fill = FillState(1000, asyncio.get_running_loop())
        fill.advance(100)
        gone, kept = FillGate(fill, 0, 8), FillGate(fill, 0, 8)
        outcome: dict[str, object] = {}

        def waits(name: str, gate: FillGate) -> None:
            try:
                gate.wait(108)  # header and the 100 bytes copied are out: waits for byte 101
                outcome[name] = fill.filled
            except ConnectionAbortedError as exc:
                outcome[name] = str(exc)
        threads = [threading.Thread(target=waits, args=("gone", gone)),
                   threading.Thread(target=waits, args=("kept", kept))]
        for t in threads:
            t.start()
        gone.interrupt()
        threads[0].join(5)
        assert not threads[1].is_alive() or "kept" not in outcome
        fill.advance(500)
        threads[1].join(5)
        return str(outcome["gone"]), int(outcome["kept"])  # type: ignore[call-overload]

    gone, kept = asyncio.run(main())
    assert "lost its link" in gone
    assert kept == 500
