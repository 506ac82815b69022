"""The synchronous decentralized algorithms: gossip with neighbors every step (D-SGD and its
corrections, compressed gossip) and the allreduce baseline."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from decent.core.surface.client import Client
from decent.core.training.algorithms.base import (
    AdaptThenCombine,
    Algorithm,
    AlgorithmError,
    Arithmetic,
    Hierarchical,
    State,
)
from decent_wire.protocol import COMPRESSORS

T = TypeVar("T", bound=Arithmetic)


class DSGD(AdaptThenCombine[T]):
    """Adapt-then-combine D-SGD: ``x' = W (x - d)``; with a momentum optimizer, DmSGD."""

    name = "dsgd"


class DSGDCombineThenAdapt(Hierarchical[T]):
    """Combine-then-adapt D-SGD: ``x' = W x - d(x)``; ``W x`` overlaps forward/backward.

    In place (:attr:`overlaps_in_place`), ``W x`` is taken from the parameters themselves
    while the gradient is computed; before the optimizer's step, ``W x - x`` is kept (in
    ``W x``'s own tensors), and after it, added to the ``x - d`` the step wrote: the same
    rule, with no copy of ``x`` kept and none written back.
    """

    name = "dsgd-cta"
    starts_early = True
    overlaps_in_place = True

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        #: ``W x - x`` of this step, once settled (in place)
        self._moves: list[T] | None = None

    def start_in_place(self, xs: Sequence[T]) -> None:
        if self.communicates and "x" not in self._pending:
            self.mix_async("x", xs)

    def settle_in_place(self, xs: Sequence[T]) -> None:
        if not self.communicates:
            self._moves = None
            return
        self.start_in_place(xs)
        moves = self.mixed("x")  # this rank's own new tensors
        for wx, x in zip(moves, xs, strict=True):
            wx -= x
        self._moves = moves

    def finish_in_place(self, halves: Sequence[T]) -> None:
        moves, self._moves = self._moves, None
        if moves is not None:  # None: a step without an exchange (x' = x - d)
            for half, move in zip(halves, moves, strict=True):
                half += move

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        self.start_in_place(xs)  # the same exchange, of copies of the parameters

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        if not self.communicates:
            return self.halves(xs, ds)
        self.start(xs, states)
        out = []
        for wx, d in zip(self.mixed("x"), ds, strict=True):  # this rank's own new tensors
            wx -= d
            out.append(wx)
        return out


class AllreduceBaseline(AdaptThenCombine[T]):
    """PmSGD: every worker takes its local step, then all average globally."""

    name = "allreduce"
    needs = ()

    def combine(self) -> tuple[str, bool] | None:
        """The global mean, every ``communication_interval``-th iteration."""
        return ("x", True) if self.communicates else None


class PeriodicGlobalAveraging(AdaptThenCombine[T]):
    """ATC D-SGD whose every ``period``-th combine is a global average."""

    name = "pga"
    defaults: ClassVar[dict[str, Any]] = {"period": 8, "hierarchical": False}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        if int(self.options["period"]) < 1:
            raise AlgorithmError(f"pga: period must be >= 1, got {self.options['period']}")

    def combine(self) -> tuple[str, bool] | None:
        """The global mean every ``period``-th iteration, else D-SGD's."""
        if (self.iteration + 1) % int(self.options["period"]) == 0:
            return ("g", True)
        return super().combine()


class GradientTracking(Algorithm[T]):
    """DIGing: ``x' = W x - y``, ``y' = W y + d(x') - d(x)``, ``y_0 = d_0`` (both exchanges
    start before the forward pass)."""

    name = "gradient-tracking"
    starts_early = True

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        if "x" in self._pending:
            return
        self.mix_async("x", xs)
        if all("y" in s for s in states):
            self.mix_async("y", [s["y"] for s in states])

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        self.start(xs, states)
        wys = self.mixed("y") if "y" in self._pending else None
        wxs = self.mixed("x")
        out = []
        # the mixed results are this rank's own new tensors: updated in place (no allocation)
        for i, (wx, d, s) in enumerate(zip(wxs, ds, states, strict=True)):
            if wys is None:
                y = d
            else:
                y = wys[i]
                y += d
                y -= s["d"]
            s["y"], s["d"] = y, d
            wx -= y
            out.append(wx)
        return out


class Extra(Algorithm[T]):
    """EXTRA: ``x^{k+2} = x^{k+1} + W x^{k+1} - (x^k + W x^k)/2 - (d_{k+1} - d_k)``, and
    ``x^1 = W x^0 - d_0`` (one exchange per iteration, started before the forward pass)."""

    name = "extra"
    needs = ("doubly-stochastic", "symmetric")
    starts_early = True

    def start(self, xs: Sequence[T], states: Sequence[State]) -> None:
        if "x" not in self._pending:
            self.mix_async("x", xs)

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        self.start(xs, states)
        out = []
        for x, wx, d, s in zip(xs, self.mixed("x"), ds, states, strict=True):
            if "x" not in s:
                new = wx - d
            else:  # x + wx - (x_prev + wx_prev)/2 - d + d_prev, in wx_prev's tensor (not
                new = s["wx"]  # needed after this step: no new tensor)
                new += s["x"]
                new *= -0.5
                new += x
                new += wx
                new -= d
                new += s["d"]
            s["x"], s["wx"], s["d"] = x, wx, d
            out.append(new)
        return out


class ExactDiffusion(Algorithm[T]):
    """Exact diffusion: ``psi' = x - d``; ``phi = psi' + x - psi``; ``x' = (phi + W phi)/2``
    (``psi_0 = x_0``)."""

    name = "exact-diffusion"
    needs = ("doubly-stochastic", "symmetric")
    #: x' = Wbar phi with Wbar = (I + W)/2 (exact diffusion) or W itself (D2)
    halve: ClassVar[bool] = True

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        phis = []
        for i, (x, d, s) in enumerate(zip(xs, ds, states, strict=True)):
            psi = self.difference("psi", i, x, d)  # in last step's phi
            phi = psi
            if "psi" in s:  # psi + x - psi_prev, in psi_prev's tensor (not needed after)
                phi = s["psi"]
                phi *= -1.0
                phi += psi
                phi += x
            s["psi"] = psi
            phis.append(phi)
        wphis = self.mix("phi", phis)
        out = []
        for i, (p, wp, s) in enumerate(zip(phis, wphis, states, strict=True)):
            if self.halve:  # (phi + W phi) / 2 in the mixed result
                wp += p
                wp *= 0.5
            out.append(wp)  # (a framework whose tensors never change gives a new one)
            if p is not s["psi"]:
                self.spare("psi", i, p)
        return out


class D2(ExactDiffusion[T]):
    """D2: exact diffusion with ``W`` instead of ``(I + W)/2`` (needs lambda_min(W) > -1/3)."""

    name = "d2"
    halve = False

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        for phase in self.topology.phases():
            low = float(np.linalg.eigvalsh(self.topology.matrix(phase)).min())
            if low <= -1.0 / 3.0 + 1e-9:  # the bound is strict
                raise AlgorithmError(f"algorithm 'd2' needs lambda_min(W) > -1/3, but topology "
                                     f"{self.topology.kind!r} has {low:.4f} at step {phase}; use "
                                     "'exact-diffusion' (it mixes with (I+W)/2)")


class DecentLaM(Algorithm[T]):
    """DecentLaM: ``psi = x - d``; ``m' = beta m + (x - W psi)``; ``x' = x - m'``.

    The wrapped optimizer gives the plain local step (SGD without momentum); the algorithm
    applies momentum ``beta`` to the combined direction, so the fixed point is ATC D-SGD's.
    """

    name = "decentlam"
    needs = ("doubly-stochastic", "symmetric")
    defaults: ClassVar[dict[str, Any]] = {"beta": 0.9}

    def check_optimizer(self, groups: Sequence[Mapping[str, Any]]) -> None:
        """DecentLaM applies its own momentum: the wrapped optimizer must have none."""
        moving = [g["momentum"] for g in groups if g.get("momentum")]
        if moving:
            raise AlgorithmError("decentlam applies its own momentum (option beta) to the "
                                 "combined update; wrap an optimizer without momentum "
                                 f"(got momentum={moving[0]})")

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        beta = float(self.options["beta"])
        psis = [self.difference("psi", i, x, d) for i, (x, d) in enumerate(zip(xs, ds,
                                                                                strict=True))]
        wpsis = self.mix("psi", psis)
        # in tensors this rank owns: g in the mixed result, m in its own, x - m in psi's
        out = []
        for i, (x, g, psi, s) in enumerate(zip(xs, wpsis, psis, states, strict=True)):
            g *= -1.0
            g += x
            if "m" in s:
                s["m"] *= beta
                s["m"] += g
            else:
                s["m"] = g
            psi *= 0.0
            psi += x
            psi -= s["m"]
            out.append(psi)  # (a framework whose tensors never change gives a new one)
            self.spare("psi", i, psi)
        return out


class Choco(Algorithm[T]):
    """CHOCO-SGD: gossip of compressed differences to public copies.

    ``q = Q(x - d - xhat)`` travels compressed (the daemon's compressed_neighbor_allreduce);
    ``xhat += q``, ``s += sum_j w_ij q_j`` (``s = sum_j w_ij xhat_j``), and
    ``x' = x - d + consensus_step * (s - xhat)``. ``xhat`` and ``s`` start at 0 and live in the
    optimizer state. With ``topk`` at ratio 1 and consensus_step 1 it is ATC D-SGD.
    """

    name = "choco"
    needs = ("doubly-stochastic", "symmetric", "static")
    #: topk 10% wants a small consensus step (0.5 left the digits workers apart, see
    #: benchmarks/convergence.py); int8 is nearly lossless and takes 0.8
    defaults: ClassVar[dict[str, Any]] = {"compressor": "topk", "ratio": 0.1,
                                          "consensus_step": 0.2}

    def __init__(self, client: Client[T], **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        comp, ratio = self.options["compressor"], self.options["ratio"]
        if comp not in COMPRESSORS:
            raise AlgorithmError(f"choco: unknown compressor {comp!r}; known: "
                                 f"{', '.join(sorted(COMPRESSORS))}")
        if comp == "topk" and not 0.0 < float(ratio) <= 1.0:
            raise AlgorithmError(f"choco: topk needs 0 < ratio <= 1, got {ratio}")
        if not 0.0 < float(self.options["consensus_step"]) <= 1.0:
            raise AlgorithmError(f"choco: consensus_step must be in (0, 1], got "
                                 f"{self.options['consensus_step']}")

    def finish(self, xs: Sequence[T], ds: Sequence[T], states: Sequence[State]) -> list[T]:
        halves = self.halves(xs, ds)  # returned or read only in this step
        if not self.communicates:
            return halves
        comp = str(self.options["compressor"])
        ratio = float(self.options["ratio"]) if comp == "topk" else None
        step = float(self.options["consensus_step"])
        w = self._weights()
        handles, sent = [], []
        for i, (half, s) in enumerate(zip(halves, states, strict=True)):
            if "xhat" not in s:
                s["xhat"], s["s"] = half * 0.0, half * 0.0
            sent.append(self.difference("q", i, half, s["xhat"]))
            handles.append(self.client.compressed_neighbor_allreduce_async(
                sent[-1], comp, ratio=ratio, name=f"{self.prefix}.q.{i}", **w))
        out = []
        for i, (half, s, h) in enumerate(zip(halves, states, handles, strict=True)):
            result = h.wait()  # [2, *shape]: the mix of Q's, and our own Q
            self.spare("q", i, sent[i])  # copied in when it was sent
            mixed, own = result[0], result[1]
            s["xhat"] += own  # the state's own tensors, updated in place
            s["s"] += mixed
            new = self.difference("q", i, s["s"], s["xhat"])  # in the tensor just sent
            new *= step
            new += half
            out.append(new)
            self.spare("q", i, new)
        return out


