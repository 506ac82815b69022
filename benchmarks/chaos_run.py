"""The processes of the chaos benchmark (:mod:`benchmarks.chaos`).

Worker side (``python benchmarks/chaos_run.py --worker dsgd|gloo ...``, one per namespace): train
``examples/train_digits.py``'s CNN on this rank's shard of digits and append one JSON line per step
to ``steps-<rank>.jsonl`` in the scenario's directory (wall time at the step's end, its duration,
the loss, the ranks the step's average came from, the membership epoch, a digest of the
parameters before the step) and, every ``--snapshot-every`` steps, the flattened parameters
(``x-<rank>-<step>.npy``); a ``result-<rank>.json`` at the end (test accuracy, failed steps).

Parent side: :class:`Job` starts a scenario's daemons and workers in the namespaces of a
:class:`benchmarks.netns_dsgd.Runner`, follows the workers' step logs (:class:`Tail`), kills and
restarts a node, flaps a link, and reads the daemons' JSON logs (:func:`daemon_events`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/chaos_run.py` puts only benchmarks/ on it
    sys.path.insert(0, str(REPO))

from benchmarks.netns_dsgd import NODE_IF, SUBNET, BenchError, Runner  # noqa: E402
from decentd.auth import write_secret  # noqa: E402

DECENT_PORT = 7700
GLOO_PORT = 29500
MOMENTUM = 0.9
TEST_SIZE = 0.2
#: a survivor gives up after this many failed steps (each is counted as lost)
MAX_FAILED = 20


# ------------------------------------------------------------------------------ worker side


class StepLog:
    """Appends one JSON object per line, flushed at once (the parent follows the file)."""

    def __init__(self, path: Path, inc: int) -> None:
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
        self.inc = inc

    def write(self, **rec: Any) -> None:
        """One record, tagged with the worker's incarnation."""
        self.f.write(json.dumps({"inc": self.inc, **rec}) + "\n")


def flat_params(model: Any) -> Any:
    """The model's parameters as one float32 tensor (a copy)."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def digest(model: Any) -> str:
    """A short hash of the parameters' bytes: equal states have equal digests."""
    return hashlib.blake2b(flat_params(model).numpy().tobytes(), digest_size=8).hexdigest()


class Shard:
    """This rank's minibatch of each iteration (``train_digits.batches`` epoch by epoch)."""

    def __init__(self, a: argparse.Namespace, rank: int, size: int) -> None:
        from examples.train_digits import load_data

        self.a, self.rank = a, rank
        self.data = load_data(rank, size, a.batch, a.seed, TEST_SIZE)
        self._epoch = -1
        self._batches: list[Any] = []

    def batch(self, k: int) -> Any:
        """The minibatch of iteration ``k``."""
        from examples.train_digits import batches

        epoch, s = divmod(k, self.data.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches = batches(self.data, self.a.batch, self.a.seed, self.rank, epoch)
        return self._batches[s]

    def accuracy(self, model: Any) -> float:
        """Test accuracy of ``model`` in percent."""
        from examples.train_digits import accuracy

        return float(accuracy(model, self.data.x_test, self.data.y_test))


def pad(started: float, pad_ms: float) -> None:
    """Sleep until the step's compute has taken at least ``pad_ms`` (from ``started``)."""
    left = started + pad_ms / 1e3 - time.time()
    if left > 0:
        time.sleep(left)


def watch_sources(algorithm: Any) -> list[list[int]]:
    """Record the ranks each average came from (the ops' ``src_ranks``): the returned list's
    only item is the last step's."""
    seen: list[list[int]] = [[]]
    original = algorithm.mixed

    def mixed(key: str) -> Any:
        handles = list(algorithm._pending.get(key, []))
        out = original(key)
        seen[0] = sorted({int(r) for h in handles for r in h.src_ranks})
        return out

    setattr(algorithm, "mixed", mixed)  # noqa: B010 (an instance attribute over the method)
    return seen


def dsgd_train(a: argparse.Namespace, opt: Any, model: Any, shard: Shard, log: StepLog,
               sources: list[list[int]]) -> int:
    """Steps until the optimizer's iteration counter reaches ``a.steps``; the failed steps."""
    import numpy as np
    import torch.nn.functional as F

    from decent_wire.errors import DecentError

    failed = 0
    while (k := opt.algorithm.counters()["iteration"]) < a.steps:
        t0 = time.time()
        x, y = shard.batch(k)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        pad(t0, a.pad_ms)
        before = digest(model)
        try:
            opt.step()
        except DecentError as exc:
            failed += 1
            log.write(k=k + 1, t=time.time(), error=str(exc)[:400])
            if failed > MAX_FAILED:
                raise
            continue
        t1 = time.time()
        log.write(k=k + 1, t=t1, dur=t1 - t0, loss=float(loss.item()), src=sources[0],
                  epoch=opt.client.view_epoch, d=before)
        if (k + 1) % a.snapshot_every == 0 or a.inc:  # a rejoined rank: every step
            np.save(a.out_dir / f"x-{a.rank}-{k + 1}.npy", flat_params(model).numpy())
    return failed


def dsgd_worker(a: argparse.Namespace) -> dict[str, Any]:
    """D-SGD (``DecentralizedOptimizer`` around SGD with momentum) on the daemon's topology. A
    worker whose daemon restarted takes its state from a donor in the optimizer's constructor."""
    import torch

    import decent.torch as dt
    from examples.train_digits import make_model

    torch.set_num_threads(1)
    log = StepLog(a.out_dir / f"steps-{a.rank}.jsonl", a.inc)
    log.write(event="process", t=time.time())
    client = dt.connect()
    shard = Shard(a, client.rank, client.size)
    torch.manual_seed(a.seed)  # the same initial model on every rank, without a broadcast
    model = make_model()
    local = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=MOMENTUM)
    t_opt = time.time()
    opt = dt.DecentralizedOptimizer(local, model, algorithm="dsgd", client=client,
                                    prefix="chaos")
    first = int(opt.algorithm.counters()["iteration"])
    log.write(event="ready", t=time.time(), rejoining=client.rejoining, iteration=first,
              d=digest(model), state_s=time.time() - t_opt)
    if not client.rejoining:
        client.barrier(name="chaos.start")
    log.write(event="start", t=time.time())
    failed = dsgd_train(a, opt, model, shard, log, watch_sources(opt.algorithm))
    acc = shard.accuracy(model)
    log.write(event="done", t=time.time())
    opt.close()
    client.close()
    return {"rank": a.rank, "inc": a.inc, "accuracy": acc, "failed_steps": failed,
            "first_iteration": first, "rejoining": bool(client.rejoining)}


def gloo_worker(a: argparse.Namespace) -> dict[str, Any]:
    """Data-parallel SGD with momentum: gloo ``all_reduce`` of the flattened gradients each
    step. A failed collective ends the worker (what a torch.distributed job does)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from examples.train_digits import make_model

    torch.set_num_threads(1)
    log = StepLog(a.out_dir / f"steps-{a.rank}.jsonl", a.inc)
    log.write(event="process", t=time.time())
    dist.init_process_group("gloo", init_method=f"tcp://{SUBNET}.1:{GLOO_PORT}", rank=a.rank,
                            world_size=a.size,
                            timeout=datetime.timedelta(seconds=a.gloo_timeout))
    shard = Shard(a, a.rank, a.size)
    torch.manual_seed(a.seed)
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=a.lr, momentum=MOMENTUM)
    log.write(event="ready", t=time.time(), rejoining=False, iteration=0)
    dist.barrier()
    log.write(event="start", t=time.time())
    for k in range(a.steps):
        t0 = time.time()
        x, y = shard.batch(k)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        pad(t0, a.pad_ms)
        grads = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        try:
            dist.all_reduce(grads)
        except Exception as exc:  # the job is dead: say when and why, then end
            log.write(k=k + 1, t=time.time(), error=f"{type(exc).__name__}: {exc}"[:400])
            return {"rank": a.rank, "inc": a.inc, "accuracy": None, "failed_steps": 1,
                    "first_iteration": 0, "rejoining": False, "ok": False}
        grads /= a.size
        for p, g in zip(params, grads.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))  # type: ignore[union-attr]
        opt.step()
        t1 = time.time()
        log.write(k=k + 1, t=t1, dur=t1 - t0, loss=float(loss.item()))
    acc = shard.accuracy(model)
    dist.destroy_process_group()
    return {"rank": a.rank, "inc": a.inc, "accuracy": acc, "failed_steps": 0,
            "first_iteration": 0, "rejoining": False}


WORKERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "dsgd": dsgd_worker, "gloo": gloo_worker}


def worker_parser() -> argparse.ArgumentParser:
    """The worker's command line (the parent builds it: :meth:`Job.worker_argv`)."""
    p = argparse.ArgumentParser(description="one chaos benchmark worker (internal)")
    p.add_argument("--worker", choices=sorted(WORKERS), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--inc", type=int, default=0, help="0, or 1 for a restarted worker")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad-ms", type=float, default=0.0)
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--gloo-timeout", type=float, default=60.0)
    p.add_argument("--out-dir", type=Path, required=True)
    return p


def worker_main(argv: list[str] | None = None) -> int:
    """Run one worker; exit 0 when it trained to the end."""
    a = worker_parser().parse_args(argv)
    res = WORKERS[a.worker](a)
    (a.out_dir / f"result-{a.rank}-{a.inc}.json").write_text(json.dumps(res))
    return 0 if res.get("ok", True) else 1


# ------------------------------------------------------------------------------ parent side


class Tail:
    """Follows every rank's step log: the records so far, the last step per rank."""

    def __init__(self, out_dir: Path, nodes: int) -> None:
        self.paths = [out_dir / f"steps-{r}.jsonl" for r in range(nodes)]
        self._pos = [0] * nodes
        self.records: list[list[dict[str, Any]]] = [[] for _ in range(nodes)]
        self.step = [0] * nodes  #: the last step each rank logged

    def poll(self) -> None:
        """Read what the workers appended since the last call (whole lines only)."""
        for r, path in enumerate(self.paths):
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                f.seek(self._pos[r])
                chunk = f.read()
                end = chunk.rfind(b"\n") + 1
                self._pos[r] += end
                for line in chunk[:end].splitlines():
                    rec = json.loads(line)
                    self.records[r].append(rec)
                    if "k" in rec and "error" not in rec:
                        self.step[r] = int(rec["k"])


def load_records(out_dir: Path, nodes: int) -> list[list[dict[str, Any]]]:
    """Every rank's step log, whole."""
    tail = Tail(out_dir, nodes)
    tail.poll()
    return tail.records


class Job:
    """One scenario: its daemons and workers in the namespaces, and the times of what the
    parent did to them (``events``: name -> wall time)."""

    def __init__(self, runner: Runner, a: argparse.Namespace, name: str, kind: str) -> None:
        self.runner, self.a, self.name, self.kind = runner, a, name, kind
        self.nodes = runner.net.nodes
        self.out = runner.run_dir / name
        self.out.mkdir()
        self.tail = Tail(self.out, self.nodes)
        self.daemons: dict[int, subprocess.Popen[bytes]] = {}
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.events: dict[str, float] = {}
        self.labels: dict[str, str] = {}  #: "worker-3" -> its current log's label
        self.sockets = [self.out / f"d{i}.sock" for i in range(self.nodes)]
        self.secret = write_secret(self.out / "secret")

    def config(self, i: int) -> Path:
        """Node ``i``'s ``node.yaml`` (the same file when it restarts)."""
        net, a = self.runner.net, self.a
        peers = [f"{net.ip(j)}:{DECENT_PORT}" for j in range(self.nodes)]
        cfg = self.out / f"node-{i}.yaml"
        cfg.write_text(
            f"cluster_id: chaos-{self.name}\nrank: {i}\npeers: {json.dumps(peers)}\n"
            f'listen: "{peers[i]}"\nsocket: {self.sockets[i]}\n'
            "topology: {kind: exponential}\nmemory: {arena_bytes: 67108864}\n"
            "log_level: info\nlog_format: json\n"
            f"timeouts: {{heartbeat: {a.heartbeat}}}\n"
            f"faults: {{peer_dead_after: {a.dead_after}, on_peer_loss: reweight}}\n"
            f"security: {{mode: secret, secret_file: {self.secret}}}\n")
        return cfg

    def start_daemon(self, i: int, inc: int = 0) -> None:
        """Start node ``i``'s daemon (a stale socket of a killed one is removed first)."""
        for path in (self.sockets[i], Path(f"{self.sockets[i]}.data")):
            path.unlink(missing_ok=True)
        daemon_bin = Path(sys.executable).parent / "decentd"
        label = self.labels[f"decentd-{i}"] = f"{self.name}/decentd-{i}-{inc}"
        self.daemons[i] = self.runner.spawn(i, label,
                                            [str(daemon_bin), "--config", str(self.config(i))])

    def start_all(self) -> None:
        """Every daemon (for D-SGD, up to their sockets) and then every worker."""
        self.events["spawn"] = time.time()
        if self.kind == "dsgd":
            for i in range(self.nodes):
                self.start_daemon(i)
            deadline = time.monotonic() + 90
            while not all(s.exists() for s in self.sockets):
                self.check()
                if time.monotonic() > deadline:
                    raise BenchError(f"{self.name}: decentd sockets missing after 90 s")
                time.sleep(0.05)
        for i in range(self.nodes):
            self.start_worker(i)

    def worker_argv(self, i: int, inc: int) -> list[str]:
        """Worker ``i``'s command line."""
        a = self.a
        return [sys.executable, str(Path(__file__).resolve()), "--worker", self.kind,
                "--rank", str(i), "--size", str(self.nodes), "--inc", str(inc),
                "--steps", str(a.steps), "--batch", str(a.batch), "--lr", str(a.lr),
                "--seed", str(a.seed), "--pad-ms", str(a.pad_ms),
                "--snapshot-every", str(a.snapshot_every), "--gloo-timeout", str(a.gloo_timeout),
                "--out-dir", str(self.out)]

    def start_worker(self, i: int, inc: int = 0) -> None:
        """Start worker ``i`` (``inc`` 1: after its node restarted)."""
        env = {"DECENT_DAEMON": str(self.sockets[i]), "DECENT_RANK": str(i),
               "DECENT_SIZE": str(self.nodes), "DECENT_JOB": f"chaos-{self.name}",
               "GLOO_SOCKET_IFNAME": NODE_IF}
        label = self.labels[f"worker-{i}"] = f"{self.name}/worker-{i}-{inc}"
        self.workers[i] = self.runner.spawn(i, label, self.worker_argv(i, inc), env)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``'s worker and daemon (their whole process groups)."""
        self.events["kill"] = time.time()
        for proc in (self.workers.get(i), self.daemons.get(i)):
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in (self.workers.pop(i, None), self.daemons.pop(i, None)):
            if proc is not None:
                proc.wait()

    def restart(self, i: int) -> None:
        """Node ``i`` again: its daemon with the same config and a new worker, at once."""
        self.events["restart"] = time.time()
        self.start_daemon(i, inc=1)
        self.start_worker(i, inc=1)

    def set_link(self, i: int, up: bool) -> None:
        """Node ``i``'s veth up or down, inside its namespace."""
        self.events["flap_up" if up else "flap_down"] = time.time()
        subprocess.run(["ip", "-n", self.runner.net.ns[i], "link", "set", NODE_IF,
                        "up" if up else "down"], check=True, capture_output=True)

    def check(self, allow_fail: bool = False) -> None:
        """BenchError (with log tails) when a worker failed or a daemon ended."""
        bad = {f"worker-{i}": p.returncode for i, p in self.workers.items()
               if p.poll() not in (None, 0) and not allow_fail}
        bad.update({f"decentd-{i}": p.returncode for i, p in self.daemons.items()
                    if p.poll() is not None})
        if bad:
            raise BenchError(f"{self.name}: exited early: {bad}\n"
                             + self.runner.tails([self.labels[k] for k in bad]))

    def wait(self, done: Callable[[], bool], what: str, timeout: float,
             allow_fail: bool = False, tick: Callable[[], None] | None = None) -> None:
        """Poll the step logs until ``done()``; BenchError on a failure or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            self.tail.poll()
            if tick is not None:
                tick()
            if done():
                return
            self.check(allow_fail)
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: timed out after {timeout:.0f} s waiting for "
                                 f"{what}; steps {self.tail.step}")
            time.sleep(0.005)

    def wait_step(self, rank: int, k: int, tick: Callable[[], None] | None = None) -> None:
        """Until rank ``rank`` has logged step ``k``."""
        self.wait(lambda: self.tail.step[rank] >= k, f"rank {rank} at step {k}",
                  self.step_timeout(k), tick=tick)

    def step_timeout(self, steps: int) -> float:
        """A generous bound for ``steps`` steps (plus start-up)."""
        return 180 + steps * (self.a.pad_ms / 1e3 + 1.0)

    def finish(self, tick: Callable[[], None] | None = None) -> None:
        """Wait for every worker to exit 0, then stop the daemons."""
        self.wait(lambda: all(p.poll() == 0 for p in self.workers.values()), "the workers",
                  self.step_timeout(self.a.steps), tick=tick)
        self.stop()

    def stop(self) -> None:
        """Stop whatever of this job still runs."""
        self.runner.cleanup.stop_procs([*self.workers.values(), *self.daemons.values()])
        self.tail.poll()

    def results(self) -> list[dict[str, Any]]:
        """Every worker's result file (a restarted worker's too)."""
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("result-*.json"))]


def parse_time(text: str) -> float:
    """Seconds since the epoch of a daemon log's ``2026-11-23T11:25:01.123Z``."""
    when = datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")
    return when.replace(tzinfo=datetime.UTC).timestamp()


LOG_EVENTS = {"down": r"rank (\d+) is down", "dropped": r"rank (\d+): link dropped",
              "up": r"rank (\d+) is up", "restarted": r"rank (\d+) restarted"}


def daemon_events(out_dir: Path) -> list[dict[str, Any]]:
    """What the daemons logged about their peers: ``{"t", "daemon", "event", "peer",
    "message"}``, in time order (from every daemon log of the scenario, JSON lines)."""
    found = []
    for path in sorted(out_dir.glob("decentd-*.log")):
        daemon = int(path.name.split("-")[1])
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            for event, pattern in LOG_EVENTS.items():
                m = re.match(pattern, str(rec.get("message", "")))
                if m and "time" in rec:
                    found.append({"t": parse_time(rec["time"]), "daemon": daemon,
                                  "event": event, "peer": int(m.group(1)),
                                  "message": rec["message"][:300]})
    return sorted(found, key=lambda e: e["t"])


if __name__ == "__main__":
    sys.exit(worker_main())
