"""One rank of tests/test_horovod.py's rules test, run under ``decentrun -np 2`` and ``-np 4``:
what a Horovod user's script expects of ``import decent.torch as hvd``, each with Horovod's
expected values; on 4 ranks, BlueFog's programs' calls too (tests/bluefog_rules.py)."""

from __future__ import annotations

import warnings

import bluefog_rules
import torch

import decent.torch as hvd


def scaled_integers() -> None:
    """prescale/postscale on an integer tensor: scaled, and the dtype kept."""
    t = torch.full((3,), 4, dtype=torch.int32)
    out = hvd.allreduce(t, op=hvd.Sum, name="int.scaled", prescale_factor=0.5,
                        postscale_factor=3.0)
    assert out.dtype == torch.int32, out.dtype
    assert torch.equal(out, torch.full((3,), 2 * hvd.size() * 3, dtype=torch.int32)), out


def names_stay_taken_until_synchronized() -> None:
    """A name is taken until its handle is synchronized, even once the op completed."""
    for start in (lambda n: hvd.allreduce_async(torch.ones(2), name=n),
                  lambda n: hvd.broadcast_async(torch.ones(2), root_rank=0, name=n),
                  lambda n: hvd.allgather_async(torch.ones(1, 2), name=n)):
        handle = start("taken")
        while not hvd.poll(handle):
            pass  # completed, not synchronized
        try:
            start("taken")
        except ValueError as exc:
            assert "taken" in str(exc), exc
        else:
            raise AssertionError("a name in use was accepted again")
        hvd.synchronize(handle)
        hvd.synchronize(start("taken"))  # free again


def gradients_average() -> None:
    """hvd.broadcast and hvd.allgather: backward averages (Horovod's rule)."""
    x = torch.ones(3, requires_grad=True)
    hvd.broadcast(x, root_rank=0, name="bcast.grad").sum().backward()
    want = 1.0 if hvd.rank() == 0 else 0.0
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), want)), x.grad
    y = torch.ones(2, 3, requires_grad=True)
    hvd.allgather(y, name="gather.grad").sum().backward()
    assert y.grad is not None and torch.equal(y.grad, torch.ones(2, 3)), y.grad


def optimizer_state_without_gradients() -> None:
    """broadcast_optimizer_state where some parameters have no gradient and no state, where
    a state value is None (SGD without momentum), and before any step (no state at all)."""
    for make, kept in ((lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), [2, 3]),
                       (lambda ps: torch.optim.SGD(ps, lr=0.1), []),
                       (lambda ps: torch.optim.Adam(ps, lr=0.1), [2, 3])):
        torch.manual_seed(hvd.rank())
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        model[0].bias.requires_grad_(False)
        opt = make(model.parameters())
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # nothing yet
        model[1](torch.ones(1, 3) * (hvd.rank() + 1)).sum().backward()  # the second layer only
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()["state"]
        assert sorted(state) == kept, sorted(state)
        for key in ("momentum_buffer", "exp_avg"):
            if kept and state[2].get(key) is not None:
                root = hvd.broadcast(state[2][key], root_rank=0, name=f"check.{key}")
                assert torch.equal(state[2][key], root), key


def names_and_positional_op() -> None:
    """hvd.allreduce(t, hvd.Sum) and Horovod's query functions."""
    out = hvd.allreduce(torch.ones(2), hvd.Sum, name="positional")
    assert torch.equal(out, torch.full((2,), float(hvd.size()))), out
    assert hvd.is_initialized() and not hvd.mpi_threads_supported() and not hvd.nccl_built()
    assert (hvd.cross_rank(), hvd.cross_size()) == (hvd.machine_rank(), hvd.machine_size())


def step_after_synchronize_warns() -> None:
    """step() after an explicit synchronize(), outside skip_synchronize(): Horovod's warning."""
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert any("optimizer.step() called without optimizer.skip_synchronize()" in str(w.message)
               for w in caught), [str(w.message) for w in caught]


def main() -> None:
    hvd.init()
    checks = [scaled_integers, names_stay_taken_until_synchronized, gradients_average,
              optimizer_state_without_gradients, names_and_positional_op,
              step_after_synchronize_warns]
    if hvd.size() == bluefog_rules.N:  # BlueFog's programs, in the same processes
        checks += bluefog_rules.CHECKS
    for check in checks:
        check()
        print("passed", check.__name__, flush=True)
    hvd.shutdown()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
