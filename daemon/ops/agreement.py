"""A collective ends the same way on every rank: its participants agree on what it is.

Before a collective (allreduce, broadcast, barrier among the daemons; allgather among the
workers) runs, each participant says, for each of its tensors, what it was asked to run (a
``pb.Agreement``: op, dtype, shape, arguments, or why it cannot run it). In a group of up to
:data:`ALL_TO_ALL_UP_TO` every participant sends every other one its descriptions and waits
for theirs, and each draws the verdict from the same set; in a larger one, n(n - 1) messages per
collective would cost more than the hop they save, so each sends them to the lowest live
participant, which draws the verdict and sends it to every other one (2(n - 1) messages). Either
way every participant ends with the same verdict: run the op, or fail it with the same error
code and a message naming the ranks that disagree. Nobody gets a result from an op another rank
fails for a disagreement. Only then does the op's result go out: node-level collectives run
beside their agreement and hold their results until the verdict, which cancels them if it is
against. A participant that cannot run it (a root that is not a rank) tells the others (or the
coordinator, who tells the others) and fails at once, without waiting for them (if two such
fail, each names itself). Neighbor ops keep their pairwise checks (an op there involves only
its peers).

The agreement is an op of its own (``pb.AGREEMENT``, keys from :func:`decentd.keys.agreement`),
run by the engine like any other: timeouts, aborts, lost peers and the live view apply to it.
A collective whose own exchange is all to all among a few (a small allreduce, each sending its
tensors to every other) agrees in that exchange instead (:mod:`decentd.ops.collectives`): its
messages carry its descriptions too, under the agreement's keys and payload-free
(``Part.agreement``), so a peer that runs an agreement of its own takes them; every participant
draws the verdict from the same set before it looks at the data, and one that cannot run it
sends its descriptions alone (:func:`description_parts`). One message per peer, no agreement op.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from decent_wire import dtypes
from decent_wire.errors import DecentError
from decent_wire.ops import BY_TYPE, Agreed, Result, exchanged_rows, op_types, result_nbytes
from decent_wire.protocol import op_label
from decent_wire.v1 import decent_pb2 as pb
from decentd.errors import VERDICT_CODES
from decentd.keys import agreement, part
from decentd.ops.api import (
    Arrival,
    Level,
    OpContext,
    OpResult,
    OpSpec,
    PartSpec,
    Services,
    gather_all,
)
from decentd.ops.faults import live_group

#: what a peer sends in an agreement: its descriptions, or (a coordinator) the verdicts
M = TypeVar("M", pb.Agreement, pb.Error)

#: the message tag of descriptions
AGREE_TAG = 1 << 20
#: ... and of the verdict a coordinator sends
VERDICT_TAG = AGREE_TAG + 1
#: groups up to this size agree all to all (one hop); larger ones through a coordinator
ALL_TO_ALL_UP_TO = 3
#: the longest description a peer may send (a shape, arguments and a message)
MAX_DESCRIPTION = 64 << 10
#: the characters of a verdict's message a coordinator sends (4 bytes each at most in UTF-8)
MAX_VERDICT_TEXT = MAX_DESCRIPTION // 4 - 64
#: collectives that agree first, by the level they run at (the op table's ``agreed``)
NODE_AGREED = op_types(agreed=Agreed.NODES)
WORKER_AGREED = op_types(agreed=Agreed.WORKERS)

Start = Callable[[OpContext, float, Callable[[OpResult | None, DecentError | None], None]],
                 None]


def description(op: int, args: Any, p: PartSpec, ranks: Sequence[int],
                error: DecentError | None = None) -> pb.Agreement:
    """What a participant standing for worker ``ranks`` was asked to run for tensor ``p``."""
    shape = list(p.shape)
    if op == pb.ALLGATHER and shape:
        shape[0] = -1  # the first dimensions may differ; the sizes (in args) must not
        error = error or _allgather_problem(args, p, ranks)
    if op == pb.ALLTOALL and shape:
        shape[0] = -1  # each rank sends its own rows: checked against the others' in verdict
    error = error or _output_problem(op, args, p)
    arg_text = str(args).replace("\n", " ").strip() if args is not None else ""
    text = f"{op_label(op)} {dtypes.describe(p.dtype, p.shape)}" + \
        (f" ({arg_text})" if arg_text else "")
    d = pb.Agreement(op=op, dtype=p.dtype, shape=shape, text=text, ranks=list(ranks),
                     args=args.SerializeToString(deterministic=True) if args is not None else b"")
    if error is not None:
        d.error.CopyFrom(error.to_pb())
    return d


def _output_problem(op: int, args: Any, p: PartSpec) -> DecentError | None:
    """ARENA_ERROR when the result cannot fit the part's output region."""
    result = BY_TYPE[op].result
    if result is Result.NONE or (result in (Result.GATHERED, Result.EXCHANGED) and
                                 not p.shape):
        return None
    rows = list(args.sizes) if result is Result.GATHERED else \
        [exchanged_rows(args)] if result is Result.EXCHANGED else None
    # a segment of a staged node tensor carries the whole tensor's shape: its own bytes count
    nbytes = p.nbytes if rows is None else result_nbytes(result, p.dtype, p.shape, rows=rows)
    try:
        p.output(nbytes, f"{op_label(op)} '{p.display}' round {p.round}")
    except DecentError as err:
        return err
    return None


def _allgather_problem(args: Any, p: PartSpec, ranks: Sequence[int]) -> DecentError | None:
    sizes = [int(s) for s in args.sizes]
    rank = ranks[0]
    if not p.shape or rank >= len(sizes) or sizes[rank] != p.shape[0]:
        return DecentError(pb.INVALID_ARGUMENT, f"rank {rank}: allgather needs a tensor of at "
                           f"least one dimension and one size per rank with this rank's first "
                           f"({p.shape[0] if p.shape else None}); got sizes {sizes}")
    return None


def verdict(display: str, round_: int, got: dict[int, pb.Agreement]) -> DecentError | None:
    """The one outcome every participant draws from the same descriptions (by participant)."""
    first = got[min(got)]
    label = f"{op_label(first.op)} '{display}' round {round_}"
    failing = [r for r in sorted(got) if got[r].error.code != pb.OK]
    if failing:
        err = got[failing[0]].error
        return DecentError(err.code, f"{label}: {_ranks(got[failing[0]].ranks)} cannot run "
                                     f"it: {err.message}")
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for r in sorted(got):
        kinds.setdefault(_kind(got[r]), []).extend(got[r].ranks)
    if len(kinds) == 1:
        return _exchange_problem(label, got) if first.op == pb.ALLTOALL else None
    texts = {key: next(got[r].text for r in sorted(got) if _kind(got[r]) == key)
             for key in kinds}
    told = "; ".join(f"{_ranks(ranks)} {texts[key]}" for key, ranks in
                     sorted(kinds.items(), key=lambda kv: kv[1][0]))
    return DecentError(pb.MISMATCH, f"{label}: the ranks disagree, so none runs it: {told}")


def _kind(d: pb.Agreement) -> tuple[Any, ...]:
    """What must be the same in every participant's description (an alltoall's rows differ
    from rank to rank: only whether and how it reduces must not)."""
    if d.op == pb.ALLTOALL:
        args = pb.Alltoall.FromString(d.args)
        return d.op, d.dtype, tuple(d.shape), args.reduce if args.HasField("reduce") else None
    return d.op, d.dtype, tuple(d.shape), d.args


def _exchange_problem(label: str, got: dict[int, pb.Agreement]) -> DecentError | None:
    """MISMATCH unless each rank expects from every other the rows that one sends it."""
    rows = {}
    for d in got.values():
        args = pb.Alltoall.FromString(d.args)
        rows[d.ranks[0]] = (list(args.send_rows), list(args.recv_rows))
    for i, (send, _) in sorted(rows.items()):
        for j, (_, recv) in sorted(rows.items()):
            if j < len(send) and i < len(recv) and send[j] != recv[i]:
                return DecentError(pb.MISMATCH, f"{label}: rank {i} sends {send[j]} rows to "
                                   f"rank {j}, which expects {recv[i]}, so none runs it")
    return None


def outcome(verdict: DecentError | None, error: DecentError | None) -> DecentError | None:
    """How a collective that ran beside its agreement ends: a verdict from the descriptions
    wins (every rank has it); else the op's own error, else the agreement's."""
    if verdict is not None and (verdict.code in VERDICT_CODES or error is None):
        return verdict
    return error


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0, 1, 2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


async def agree(ctx: OpContext) -> OpResult:
    """The agreement op: descriptions to and from every live participant (a few of them), or
    through the lowest live one (more), then the verdict."""
    group = live_group(ctx)
    mine = [pb.Agreement.FromString(bytes(p.raw)) for p in ctx.parts]
    refused = next((i for i, d in enumerate(mine) if d.error.code != pb.OK), None)
    if len(group) > ALL_TO_ALL_UP_TO:
        return OpResult(0, (), group, verdict=await _through_coordinator(ctx, group, mine,
                                                                         refused))
    others = [r for r in group if r != ctx.rank]
    if refused is not None:  # it fails whatever the others say: tell them, and fail now
        await gather_all(*(ctx.send(r, AGREE_TAG) for r in others))
        return OpResult(0, (), group, verdict=_refusal(ctx, mine, refused))
    futs = _expect(ctx, others, AGREE_TAG)
    try:
        await gather_all(*(ctx.send(r, AGREE_TAG) for r in others))
        arrived = {r: await asyncio.gather(*fs) for r, fs in futs.items()}
    finally:
        _drop(futs)
    return OpResult(0, (), group, verdict=first_against([
        ruling(ctx, i, mine[i], {r: arrived[r][i] for r in others})
        for i in range(len(ctx.parts))]))


def _refusal(ctx: OpContext, mine: list[pb.Agreement], refused: int) -> DecentError | None:
    """The verdict of a participant that cannot run it: its own description says why."""
    p = ctx.parts[refused]
    return verdict(p.display, p.round, {ctx.rank: mine[refused]})


def first_against(rulings: Sequence[DecentError | None]) -> DecentError | None:
    """The op's verdict: its first part's against, if any."""
    return next((r for r in rulings if r is not None), None)


async def _through_coordinator(ctx: OpContext, group: list[int], mine: list[pb.Agreement],
                               refused: int | None) -> DecentError | None:
    """The lowest live participant collects every description and sends each other one the
    verdict it draws for each tensor (ranks may have fused them differently): 2(n - 1)
    messages instead of n(n - 1), in two hops instead of one."""
    head, others = group[0], group[1:]
    if ctx.rank == head:
        return await _coordinate(ctx, others, mine, refused)
    if refused is not None:  # tell the coordinator (who tells the others), fail now
        await ctx.send(head, AGREE_TAG)
        return _bounded(_refusal(ctx, mine, refused))
    told = _expect(ctx, [head], VERDICT_TAG)
    try:
        await ctx.send(head, AGREE_TAG)
        arrivals = await asyncio.gather(*told[head])
    finally:
        _drop(told)
    rulings = [_parse_verdict(ctx, head, a.data) for a in arrivals]
    for a in arrivals:
        ctx.release(a)
    return first_against(rulings)


async def _coordinate(ctx: OpContext, others: list[int], mine: list[pb.Agreement],
                      refused: int | None) -> DecentError | None:
    """The coordinator's part: each tensor's verdict from every description (or this rank's
    refusal), sent to ``others`` as soon as that tensor's descriptions are all in (a rank that
    fused it with other tensors than here does not wait for those); the first against."""
    if refused is not None:
        rulings: list[DecentError | None] = \
            [_bounded(_refusal(ctx, mine, refused))] * len(ctx.parts)
        await _tell(ctx, others, range(len(ctx.parts)), rulings)
        return first_against(rulings)
    futs = _expect(ctx, others, AGREE_TAG)
    ready = [asyncio.gather(*(futs[r][i] for r in others)) for i in range(len(ctx.parts))]
    rulings = [None] * len(ctx.parts)
    pending = set(range(len(ctx.parts)))
    try:
        while pending:
            await asyncio.wait([ready[i] for i in pending], return_when=asyncio.FIRST_COMPLETED)
            done = [i for i in sorted(pending) if ready[i].done()]
            for i in done:
                rulings[i] = _bounded(ruling(ctx, i, mine[i], dict(zip(
                    others, ready[i].result(), strict=True))))
            pending.difference_update(done)
            await _tell(ctx, others, done, rulings)
    finally:
        _drop(futs)
        for g in ready:  # their failures are the op's (raised above), not for the loop's log
            g.add_done_callback(_retrieved)
    return first_against(rulings)


def _expect(ctx: OpContext, ranks: Sequence[int], tag: int
            ) -> dict[int, list[asyncio.Future[Arrival]]]:
    """Each part's message with ``tag`` from each of ``ranks``, expected from now on; the op
    waits for a rank (stall and timeout messages name it) until all of its are in."""
    mailbox = ctx.services.mailbox
    futs = {r: [mailbox.expect(r, p.name, p.round, tag) for p in ctx.parts] for r in ranks}
    for r, fs in futs.items():
        ctx.waiting.add(r)
        asyncio.gather(*fs).add_done_callback(functools.partial(_heard, ctx, r))
    return futs


def _drop(futs: dict[int, list[asyncio.Future[Arrival]]]) -> None:
    """No longer expect what is still to come of ``futs``."""
    for fs in futs.values():
        for f in fs:
            f.cancel()


def _heard(ctx: OpContext, rank: int, _done: asyncio.Future[Any]) -> None:
    """All that ``rank`` had to say has come (or will not): the op no longer waits for it."""
    ctx.waiting.discard(rank)
    _retrieved(_done)


def _retrieved(done: asyncio.Future[Any]) -> None:
    """Mark ``done``'s failure as seen (the op reports it)."""
    if not done.cancelled():
        done.exception()


def ruling(ctx: OpContext, i: int, mine: pb.Agreement, arrived: dict[int, Arrival]
           ) -> DecentError | None:
    """Part ``i``'s verdict from this rank's description and the others' (their arrivals,
    released here)."""
    got = {ctx.rank: mine}
    for r, a in arrived.items():  # (a peer agreeing in its exchange says it in ``agreement``)
        got[r] = _parse(ctx, r, np.frombuffer(a.agreement, np.uint8) if a.agreement else a.data)
        ctx.release(a)
    p = ctx.parts[i]
    return _bounded(verdict(p.display, p.round, got))


async def _tell(ctx: OpContext, others: list[int], parts: Iterable[int],
                rulings: list[DecentError | None]) -> None:
    """Send ``others`` the verdicts of ``parts`` (indexes), one message each. A send that
    fails (a peer lost meanwhile) does not stop the others: that peer's op fails on its own."""
    said = [_verdict_part(ctx.parts[i], rulings[i]) for i in parts]
    if said:
        await asyncio.gather(*(ctx.send(r, VERDICT_TAG, parts=said) for r in others),
                             return_exceptions=True)


def _bounded(ruled: DecentError | None) -> DecentError | None:
    """``ruled`` with its message cut to what a verdict may carry (:data:`MAX_DESCRIPTION`
    bytes), so that the coordinator fails with the very message it sends."""
    if ruled is None or len(ruled.message) <= MAX_VERDICT_TEXT:
        return ruled
    return DecentError(ruled.code, ruled.message[:MAX_VERDICT_TEXT] + " [cut]")


def _verdict_part(p: PartSpec, ruled: DecentError | None) -> PartSpec:
    """Tensor ``p``'s verdict as a part to send (``pb.Error``; empty: run it)."""
    raw = (ruled.to_pb() if ruled is not None else pb.Error()).SerializeToString()
    return PartSpec.over(p.name, p.display, p.round, pb.UINT8, (0,),
                         np.frombuffer(raw, np.uint8), memoryview(b""), memoryview(raw))


def _parse(ctx: OpContext, src: int, data: np.ndarray) -> pb.Agreement:
    """A peer's description, checked."""
    return _checked(ctx, src, data, pb.Agreement, "description")


def _parse_verdict(ctx: OpContext, src: int, data: np.ndarray) -> DecentError | None:
    """The coordinator's verdict (``pb.Error``; OK: run it), checked."""
    said = _checked(ctx, src, data, pb.Error, "verdict")
    return None if said.code == pb.OK else DecentError.from_pb(said)


def _checked(ctx: OpContext, src: int, data: np.ndarray, kind: type[M], what: str) -> M:
    """Message ``kind`` from rank ``src``'s ``data``: INVALID_ARGUMENT if it is too long or
    does not parse (a peer that speaks another protocol)."""
    if data.nbytes > MAX_DESCRIPTION:
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: rank {src} sent a {what} of "
                          f"{data.nbytes} bytes (at most {MAX_DESCRIPTION})")
    try:
        return kind.FromString(data.tobytes())
    except Exception:  # DecodeError
        raise DecentError(pb.INVALID_ARGUMENT, f"{ctx.label}: rank {src} sent a {what} "
                          "that does not parse") from None


def agrees_in_exchange(ctx: OpContext) -> bool:
    """Whether a collective whose exchange is all to all agrees in it: among a few live
    participants, as an agreement of its own would be all to all."""
    try:
        return 1 < len(live_group(ctx)) <= ALL_TO_ALL_UP_TO
    except DecentError:  # no quorum: the op fails as it starts
        return False


def description_parts(ctx: OpContext) -> list[pb.Part]:
    """This op's descriptions as an agreement of its own sends them, payload-free (each in
    its ``agreement`` field): to go in the op's own messages, or alone (it cannot run)."""
    said = [part(agreement(p.name), p.round, AGREE_TAG, pb.AGREEMENT, pb.UINT8, (0,), 0)
            for p in ctx.parts]
    for w, p in zip(said, ctx.parts, strict=True):
        w.agreement = p.agreement.SerializeToString() if p.agreement else b""
    return said


def refused_verdict(ctx: OpContext) -> DecentError | None:
    """That participant's own verdict: what its first description that refuses says."""
    p = next((p for p in ctx.parts if p.agreement and p.agreement.error.code != pb.OK),
             ctx.parts[0])
    assert p.agreement is not None
    return _bounded(verdict(p.display, p.round, {ctx.rank: p.agreement}))


AGREEMENT_SPEC = OpSpec(agree, lambda ctx: set(live_group(ctx)) - {ctx.rank},
                        lambda _ctx: {AGREE_TAG, VERDICT_TAG}, counted=False)


class Agreements:
    """Starts the agreement that a collective's op waits for."""

    def __init__(self, services: Services, start: Start) -> None:
        self.services = services
        self._start = start

    def run(self, level: Level, parts: Sequence[PartSpec], descriptions: Sequence[pb.Agreement],
            timeout: float, then: Callable[[DecentError | None], None]) -> None:
        """Agree on ``parts`` (one description each) among ``level``'s live participants;
        ``then(error)`` once every rank's description is in (None: all agree)."""
        mine = [_agreement_part(p, d) for p, d in zip(parts, descriptions, strict=True)]
        ctx = OpContext(self.services, pb.AGREEMENT, None, mine, AGREEMENT_SPEC, level)
        try:
            self._start(ctx, timeout, lambda result, err: then(
                err or (result.verdict if result is not None else None)))
        except DecentError as err:
            then(err)


def _agreement_part(p: PartSpec, d: pb.Agreement) -> PartSpec:
    raw = d.SerializeToString()
    return PartSpec.over(agreement(p.name), p.display, p.round, pb.UINT8, (0,),
                    np.frombuffer(raw, np.uint8), memoryview(b""), memoryview(raw))
