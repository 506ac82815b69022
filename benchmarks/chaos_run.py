"""The processes of the chaos benchmark (:mod:`benchmarks.chaos`).

Workers (one per namespace) train ``examples/train_digits.py``'s CNN on their shard and append a
JSON line per step to ``steps-<rank>.jsonl`` (end time, duration, loss, the ranks the average came
from, membership epoch, a digest of the parameters before the step), the parameters every
``snapshot_every`` steps (a restarted worker: every step) to ``x-<rank>-<step>.npy``, and
``result-<rank>-<inc>.json``. The parent's :class:`Job` starts daemons and workers, follows the
step logs, kills, restarts and flaps (:func:`drive`); :func:`daemon_events` reads the daemons' logs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
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

import benchmarks.netns_dsgd as nd  # noqa: E402
from decentd.security.auth import write_secret  # noqa: E402

PREFIX = "dchs"
DECENT_PORT = 7700
GLOO_PORT = 29500
MOMENTUM = 0.9
#: a worker gives up after this many failed steps (each one is counted as lost)
MAX_FAILED = 20



class StepLog:
    """Appends one JSON object per line, flushed at once (the parent follows the file)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.f = open(a.out_dir / f"steps-{a.rank}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.inc = a.inc

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


class Trainer:
    """This rank's shard, model (seeded: the same on every rank, no broadcast) and the local
    part of a step (``train_digits``'s data, batches and model)."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        from examples.train_digits import load_data, make_model

        torch.set_num_threads(1)
        self.a, self.log = a, StepLog(a)
        self.log.write(event="process", t=time.time())
        self.data = load_data(a.rank, a.size, a.batch, a.seed, 0.2)
        torch.manual_seed(a.seed)
        self.model = make_model()
        self._epoch, self._batches = -1, list[Any]()

    def local_step(self, k: int, opt: Any) -> tuple[float, float]:
        """Iteration ``k``'s gradients, the compute padded to ``--pad-ms``: (start, loss)."""
        import torch.nn.functional as F

        from examples.train_digits import batches

        t0 = time.time()
        epoch, s = divmod(k, self.data.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches = batches(self.data, self.a.batch, self.a.seed, self.a.rank, epoch)
        x, y = self._batches[s]
        opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        time.sleep(max(0.0, t0 + self.a.pad_ms / 1e3 - time.time()))
        return t0, float(loss.item())

    def accuracy(self) -> float:
        """Test accuracy of the model in percent."""
        from examples.train_digits import accuracy

        return float(accuracy(self.model, self.data.x_test, self.data.y_test))


def watch_sources(algorithm: Any) -> list[list[int]]:
    """Record the ranks each average came from (its ops' ``src_ranks``): the returned list's
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


def dsgd_train(tr: Trainer, opt: Any) -> int:
    """Steps until the optimizer's iteration counter reaches ``--steps`` (or the wall clock
    ``until``, when the job has one); the failed steps."""
    import numpy as np

    from decent_wire.errors import DecentError

    a, failed, sources = tr.a, 0, watch_sources(opt.algorithm)
    while (k := opt.algorithm.counters()["iteration"]) < a.steps and (
            a.until is None or time.time() < a.until):
        t0, loss = tr.local_step(k, opt)
        before = digest(tr.model)
        try:
            opt.step()
        except DecentError as exc:
            failed += 1
            tr.log.write(k=k + 1, t=time.time(), error=str(exc)[:400], d=before)
            if failed > MAX_FAILED:
                raise
            continue
        t1 = time.time()
        tr.log.write(k=k + 1, t=t1, dur=t1 - t0, loss=loss, src=sources[0],
                     epoch=opt.client.view_epoch, d=before)
        if a.snapshots and ((k + 1) % a.snapshot_every == 0 or a.inc):  # a rejoined rank: all
            np.save(a.out_dir / f"x-{a.rank}-{k + 1}.npy", flat_params(tr.model).numpy())
    return failed


def dsgd_worker(a: argparse.Namespace) -> dict[str, Any]:
    """D-SGD (``DecentralizedOptimizer`` around SGD with momentum) on the daemon's topology. A
    worker whose daemon restarted takes its state from a donor in the optimizer's constructor."""
    import torch

    import decent.torch as dt

    tr = Trainer(a)
    client = dt.connect()
    t_opt = time.time()
    opt = dt.DecentralizedOptimizer(
        torch.optim.SGD(tr.model.parameters(), lr=a.lr, momentum=MOMENTUM), tr.model,
        algorithm="dsgd", client=client, prefix="chaos")
    first = int(opt.algorithm.counters()["iteration"])
    taken = opt.state_taken
    tr.log.write(event="ready", t=time.time(), rejoining=client.rejoining, iteration=first,
                 d=digest(tr.model), state_s=time.time() - t_opt,
                 taken=taken and {"seconds": taken.seconds, "refetched": taken.refetched,
                                  "bytes_from": {str(k): v for k, v in taken.bytes_from.items()}})
    if not client.rejoining and not a.inc:  # a worker restarted alone: the others train on
        client.barrier(name="chaos.start")
    tr.log.write(event="start", t=time.time())
    failed = dsgd_train(tr, opt)
    tr.log.write(event="done", t=time.time())
    opt.close()
    client.close()
    return {"rank": a.rank, "inc": a.inc, "accuracy": tr.accuracy(), "failed_steps": failed,
            "first_iteration": first, "rejoining": bool(client.rejoining)}


def gloo_worker(a: argparse.Namespace) -> dict[str, Any]:
    """Data-parallel SGD with momentum: gloo ``all_reduce`` of the flattened gradients each
    step. A failed collective ends the worker (what a torch.distributed job does)."""
    import torch
    import torch.distributed as dist

    tr = Trainer(a)
    dist.init_process_group("gloo", init_method=f"tcp://{nd.SUBNET}.1:{GLOO_PORT}", rank=a.rank,
                            world_size=a.size, timeout=datetime.timedelta(seconds=a.gloo_timeout))
    params = list(tr.model.parameters())
    opt = torch.optim.SGD(params, lr=a.lr, momentum=MOMENTUM)
    dist.barrier()
    tr.log.write(event="start", t=time.time())
    for k in range(a.steps):
        t0, loss = tr.local_step(k, opt)
        grads = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        try:
            dist.all_reduce(grads)
        except Exception as exc:  # the job is dead: say when and why, then end
            tr.log.write(k=k + 1, t=time.time(), error=f"{type(exc).__name__}: {exc}"[:400])
            return {"rank": a.rank, "inc": a.inc, "accuracy": None, "ok": False}
        for p, g in zip(params, (grads / a.size).split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))  # type: ignore[union-attr]
        opt.step()
        tr.log.write(k=k + 1, t=time.time(), dur=time.time() - t0, loss=loss)
    dist.destroy_process_group()
    return {"rank": a.rank, "inc": a.inc, "accuracy": tr.accuracy()}


WORKERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "dsgd": dsgd_worker, "gloo": gloo_worker}


def worker_main(argv: list[str]) -> int:
    """One worker: ``chaos_run.py <the job's worker.json> <rank> <incarnation>`` (see
    :class:`Job`); exit 0 when it trained to the end."""
    a = argparse.Namespace(**json.loads(Path(argv[0]).read_text()), rank=int(argv[1]),
                           inc=int(argv[2]))
    a.out_dir = Path(a.out_dir)
    res = WORKERS[a.worker](a)
    (a.out_dir / f"result-{a.rank}-{a.inc}.json").write_text(json.dumps(res))
    return 0 if res.get("ok", True) else 1



class Tail:
    """Follows every rank's step log: the records so far, the last step per rank."""

    def __init__(self, out_dir: Path, nodes: int) -> None:
        self.paths = [out_dir / f"steps-{r}.jsonl" for r in range(nodes)]
        self._pos = [0] * nodes
        self.records: list[list[dict[str, Any]]] = [[] for _ in range(nodes)]
        self.step = [0] * nodes  #: the last step each rank completed

    def poll(self) -> None:
        """Read what the workers appended since the last call (whole lines only)."""
        for r, path in enumerate(self.paths):
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                f.seek(self._pos[r])
                chunk = f.read()
                end = chunk.rfind(b"\n") + 1
                self._pos[r] += end
                for rec in map(json.loads, chunk[:end].splitlines()):
                    self.records[r].append(rec)
                    if "k" in rec and "error" not in rec:
                        self.step[r] = int(rec["k"])


def steps_of(recs: list[dict[str, Any]], inc: int | None = None) -> list[dict[str, Any]]:
    """The completed steps of a rank's log (of one incarnation), each with ``wall``: the time
    since its step before ended (failed attempts and waits included; a first step: its own)."""
    out, prev = [], None
    for r in (x for x in recs if "k" in x and "error" not in x):
        if inc in (None, r["inc"]):
            same = prev is not None and prev["inc"] == r["inc"]
            out.append({**r, "wall": r["t"] - prev["t"] if same and prev else r["dur"]})
        prev = r
    return out


def event_of(recs: list[dict[str, Any]], name: str, inc: int = 0) -> dict[str, Any] | None:
    """A rank's first record of event ``name`` (of incarnation ``inc``)."""
    return next((r for r in recs if r.get("event") == name and r["inc"] == inc), None)


def since(t: float | None, t0: float) -> float | None:
    """``t - t0``, or None."""
    return None if t is None else t - t0


def first_t(items: list[dict[str, Any]]) -> float | None:
    """The earliest ``t`` among ``items``, or None."""
    return min((i["t"] for i in items), default=None)


class Job:
    """One scenario: its daemons and workers in the namespaces, and the wall times of what the
    parent did to them (``events``)."""

    def __init__(self, runner: nd.Runner, a: argparse.Namespace, name: str) -> None:
        self.runner, self.a, self.name = runner, a, name
        self.kind = "gloo" if name == "gloo" else "dsgd"
        self.nodes = int(a.nodes)
        self.out = runner.run_dir / name
        self.out.mkdir()
        self.tail = Tail(self.out, self.nodes)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  #: "decentd-3" / "worker-3"
        self.labels: dict[str, str] = {}  #: their logs' labels
        self.events: dict[str, float] = {}
        self.sockets = [self.out / f"d{i}.sock" for i in range(self.nodes)]
        self.secret = write_secret(self.out / "secret")
        (self.out / "worker.json").write_text(json.dumps({
            "worker": self.kind, "out_dir": str(self.out), "size": self.nodes,
            "until": getattr(a, "until", None), "snapshots": getattr(a, "snapshots", True), **{
                k: getattr(a, k) for k in ("steps", "batch", "seed", "lr", "snapshot_every",
                                           "pad_ms", "gloo_timeout")}}))

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
            f"timeouts: {{heartbeat: {a.heartbeat}, op: {a.op_timeout}}}\n"
            f"faults: {{peer_dead_after: {a.dead_after}, on_peer_loss: reweight}}\n"
            f"security: {{mode: secret, secret_file: {self.secret}}}\n")
        return cfg

    def spawn(self, key: str, i: int, inc: int, argv: list[str],
              env: dict[str, str] | None = None) -> None:
        """Start ``argv`` in node ``i``'s namespace as ``key`` (its log: ``<key>-<inc>.log``)."""
        self.labels[key] = f"{self.name}/{key}-{inc}"
        self.procs[key] = self.runner.spawn(i, self.labels[key], argv, env)

    def start_daemon(self, i: int, inc: int = 0) -> None:
        """Start node ``i``'s daemon (a stale socket of a killed one is removed first)."""
        for path in (self.sockets[i], Path(f"{self.sockets[i]}.data")):
            path.unlink(missing_ok=True)
        daemon = Path(sys.executable).parent / "decentd"
        self.spawn(f"decentd-{i}", i, inc, [str(daemon), "--config", str(self.config(i))])

    def start_worker(self, i: int, inc: int = 0) -> None:
        """Start worker ``i`` (``inc`` 1: after its node restarted)."""
        env = {"DECENT_DAEMON": str(self.sockets[i]), "DECENT_RANK": str(i),
               "DECENT_SIZE": str(self.nodes), "DECENT_JOB": f"chaos-{self.name}",
               "GLOO_SOCKET_IFNAME": nd.NODE_IF}
        self.spawn(f"worker-{i}", i, inc, [sys.executable, str(Path(__file__).resolve()),
                                            str(self.out / "worker.json"), str(i), str(inc)], env)

    def start_all(self) -> None:
        """Every daemon (D-SGD), up to their sockets, then every worker."""
        self.events["spawn"] = time.time()
        if self.kind == "dsgd":
            for i in range(self.nodes):
                self.start_daemon(i)
            self.wait(lambda: all(s.exists() for s in self.sockets), "the daemons' sockets", 90)
        for i in range(self.nodes):
            self.start_worker(i)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``'s daemon and worker (their process groups; the daemon first, as
        when the node dies: it cannot tell its peers that its worker left)."""
        self.events["kill"] = time.time()
        for key in (f"decentd-{i}", f"worker-{i}"):
            proc = self.procs.pop(key, None)
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def set_link(self, i: int, up: bool) -> None:
        """Node ``i``'s veth up or down, inside its namespace."""
        self.events["flap_up" if up else "flap_down"] = time.time()
        subprocess.run(["ip", "-n", self.runner.net.ns[i], "link", "set", nd.NODE_IF,
                        "up" if up else "down"], check=True, capture_output=True)

    def wait(self, done: Callable[[], bool], what: str, timeout: float,
             tick: Callable[[], None] | None = None, failing: bool = False) -> None:
        """Poll the step logs until ``done()``; BenchError when a process ended badly (a worker
        may when ``failing``) or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            self.tail.poll()
            if tick is not None:
                tick()
            if done():
                return
            bad = {k: p.returncode for k, p in self.procs.items() if p.poll() is not None
                   and (k.startswith("decentd") or (p.returncode != 0 and not failing))}
            if bad or time.monotonic() > deadline:
                why = f"exited: {bad}" if bad else f"timed out after {timeout:.0f} s"
                raise nd.BenchError(f"{self.name}: waiting for {what}, {why}; steps "
                                 f"{self.tail.step}\n" + self.runner.tails(
                                     [self.labels[k] for k in (bad or self.procs)]))
            time.sleep(0.005)

    def wait_step(self, rank: int, k: int, tick: Callable[[], None]) -> None:
        """Until rank ``rank`` has completed step ``k``."""
        self.wait(lambda: self.tail.step[rank] >= k, f"rank {rank}'s step {k}",
                  180 + k * (self.a.pad_ms / 1e3 + 1.0), tick)

    def workers_done(self) -> bool:
        """Whether every worker has exited."""
        return all(p.poll() is not None for k, p in self.procs.items() if k.startswith("w"))

    def stop(self) -> None:
        """Stop whatever of this job still runs."""
        self.runner.cleanup.stop_procs(list(self.procs.values()))
        self.tail.poll()

    def results(self) -> list[dict[str, Any]]:
        """Every worker's result file (a restarted worker's too)."""
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("result-*.json"))]


def drive(job: Job, a: argparse.Namespace, tick: Callable[[], None],
          say: Callable[[str], None]) -> None:
    """What the scenario does to its job, at the steps the workers log, until it ends."""
    if job.name in ("kill", "gloo"):
        job.wait_step(a.kill_rank, a.kill_at, tick)
        job.kill(a.kill_rank)
        say(f"{job.name}: killed rank {a.kill_rank}'s daemon and worker at its step {a.kill_at}")
    if job.name == "kill":
        job.wait_step(0, a.restart_at, tick)
        job.events["restart"] = time.time()
        job.start_daemon(a.kill_rank, inc=1)
        job.start_worker(a.kill_rank, inc=1)
        say(f"kill: restarted rank {a.kill_rank} at rank 0's step {a.restart_at}")
    if job.name == "flap":
        job.wait_step(a.flap_rank, a.flap_at, tick)
        job.set_link(a.flap_rank, up=False)
        until = time.time() + a.flap_s
        job.wait(lambda: time.time() >= until, "the flap", a.flap_s + 60, tick)
        job.set_link(a.flap_rank, up=True)
        say(f"flap: rank {a.flap_rank}'s link was down {a.flap_s:g} s from its step {a.flap_at}")
    if job.name != "gloo":  # a worker that fails is measured (its steps are lost)
        job.wait(job.workers_done, "the workers", 180 + a.steps * (a.pad_ms / 1e3 + 1.0), tick,
                 failing=True)
        return
    with contextlib.suppress(nd.BenchError):  # survivors that hang are what is measured
        job.wait(lambda: any_exit(job) and job.workers_done(), "the survivors to fail",
                 a.gloo_timeout + 30, tick, failing=True)
    any_exit(job)


def any_exit(job: Job) -> bool:
    """Note when each worker was first seen exited (``exit-<rank>`` events); True."""
    for key, p in job.procs.items():
        if key.startswith("w") and p.poll() is not None:
            job.events.setdefault(f"exit-{key.split('-')[1]}", time.time())
    return True


def run_scenario(runner: nd.Runner, a: argparse.Namespace, name: str,
                 progress: Any) -> dict[str, Any]:
    """One scenario from a cold start: events, step logs, results, the daemons' log events."""
    job = Job(runner, a, name)
    task = progress.add_task(name, total=a.steps)

    def tick() -> None:
        progress.update(task, completed=job.tail.step[0])

    try:
        job.start_all()
        drive(job, a, tick, progress.console.print)
    finally:
        job.stop()
    tick()
    (job.out / "events.json").write_text(json.dumps(job.events))
    failed = {job.labels[k]: nd.tail(runner.run_dir / f"{job.labels[k]}.log", 2).strip()
              for k, p in job.procs.items() if k[0] == "w" and p.returncode}
    return {"events": job.events, "records": job.tail.records, "results": job.results(),
            "daemon": daemon_events(job.out), "out": job.out, "failed_workers": failed}


def cleanup_leftovers() -> list[str]:
    """Delete ``dchs*`` namespaces and run directories whose run is no longer alive."""
    def alive(name: str) -> bool:
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if not m or int(m.group(1)) == os.getpid():
            return False
        with contextlib.suppress(OSError):
            return b"chaos.py" in Path(f"/proc/{m.group(1)}/cmdline").read_bytes()
        return False

    names = [n for n in nd.leftover_namespaces(PREFIX) if not alive(n)]
    for ns in sorted(names, key=lambda n: n.endswith("-sw")):  # node namespaces first
        nd.delete_namespace(ns)
    dirs = [d for d in Path("/tmp").glob(f"{PREFIX}*-*") if d.is_dir() and not alive(d.name)]
    for d in dirs:
        for pid in nd.leftover_procs(str(d)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
    return names + [str(d) for d in dirs]


#: what the daemons log about peers and ops: event -> pattern (its number: a rank or a round)
LOG_EVENTS = {"down": r"rank (\d+) is down", "dropped": r"rank (\d+): link dropped",
              "up": r"rank (\d+) is up", "restarted": r"rank (\d+) restarted",
              "timeout": r".*timed out after (\d+)s", "stall": r"stall: .* round (\d+)",
              "rejoin_op": r".*'decent\.rejoin\.size' round (\d+)"}


def daemon_events(out_dir: Path) -> list[dict[str, Any]]:
    """``{"t", "daemon", "event", "n", "message"}`` for every daemon log line of the scenario
    that :data:`LOG_EVENTS` matches (the first pattern that does), in time order."""
    found = []
    for path in sorted(out_dir.glob("decentd-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                msg = str(rec["message"])
                when = datetime.datetime.strptime(rec["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
                for event, pattern in LOG_EVENTS.items():
                    if m := re.match(pattern, msg):
                        found.append({"t": when.replace(tzinfo=datetime.UTC).timestamp(),
                                      "daemon": int(path.name.split("-")[1]), "event": event,
                                      "n": int(m.group(1)), "message": msg[:300]})
                        break
    return sorted(found, key=lambda e: e["t"])


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
