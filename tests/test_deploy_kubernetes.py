"""deploy/kubernetes: both overlays rendered with ``kubectl kustomize``, every manifest validated
against the Kubernetes schemas (``kubernetes-validate``, strict), and the parts that must agree
checked against each other and against the daemon: the ConfigMap's node.yaml loaded by the
daemon's own loader gives peers that are exactly the StatefulSet's pods behind the headless
Service, rank = pod ordinal, the Service's and NetworkPolicy's ports, the memory sizes, and the
certificate files the init container hands to decentd."""

from __future__ import annotations

import functools
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from cryptography import x509

from decentd.security.tls import Tls
from decentd.service.config import NodeConfig, load_config
from deploy_image import REPO
from deploy_image import load as load_image

KUSTOMIZE = REPO / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu"]
K8S_VERSION = "1.33.0"
Doc = dict[str, Any]

pytestmark = [pytest.mark.deploy, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("kubectl") is None,
                                 reason="kubectl (for `kubectl kustomize`) is not installed")]


@functools.cache
def _render(overlay: str) -> str:
    proc = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(overlay: str) -> list[Doc]:
    """The overlay's manifests as ``kubectl apply -k`` would send them (fresh copies)."""
    return [d for d in yaml.safe_load_all(_render(overlay)) if d]


def one(docs: list[Doc], kind: str) -> Doc:
    """The only manifest of ``kind``."""
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def container(sts: Doc, name: str) -> Doc:
    """Container ``name`` of the StatefulSet's pod template."""
    (c,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def volume(sts: Doc, name: str) -> Doc:
    """Volume ``name`` of the pod template."""
    (v,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return v


def mount_path(c: Doc, volume_name: str) -> str:
    """Where container ``c`` mounts volume ``volume_name``."""
    (m,) = [m for m in c["volumeMounts"] if m["name"] == volume_name]
    return str(m["mountPath"])


def quantity(q: str | int) -> int:
    """A Kubernetes quantity (``256Mi``, ``1Gi``, ``1536Mi``, ``500M``) in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(q))
    assert m, q
    unit = m.group(2) or ""
    base = 1024 if unit.endswith("i") else 1000
    return int(m.group(1)) * base ** ("KMGT".index(unit[0]) + 1 if unit else 0)


def node_config(docs: list[Doc], tmp_path: Path) -> NodeConfig:
    """The ConfigMap's node.yaml loaded by decentd's loader (its socket moved to a directory
    that exists here; nothing else changed)."""
    path = tmp_path / "node.yaml"
    path.write_text(one(docs, "ConfigMap")["data"]["node.yaml"])
    return load_config(str(path), {"socket": str(tmp_path / "decentd.sock")})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_validates(overlay: str) -> None:
    """Each manifest of the overlay passes strict schema validation; all are namespaced in the
    Namespace the overlay creates."""
    docs = render(overlay)
    assert sorted(d["kind"] for d in docs) == sorted([
        "Namespace", "ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget",
        "NetworkPolicy"])
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    ns = one(docs, "Namespace")["metadata"]["name"]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {ns}


def test_validation_catches_a_broken_manifest() -> None:
    """The validator is a real check: a port given as a word and an unknown field fail."""
    sts = one(render("cpu"), "StatefulSet")
    container(sts, "decentd")["ports"][0]["containerPort"] = "seven-thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)
    sts = one(render("cpu"), "StatefulSet")
    sts["spec"]["template"]["spec"]["shmSize"] = "1Gi"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_peers_are_the_statefulset_pods_behind_the_headless_service(
        overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node.yaml's peers expand to <sts>-{i}.<svc>.<ns>.svc:<the Service's peer port> for every
    replica; the Service is headless, publishes not-ready pods and selects the pods; the pod
    ordinal in the hostname is the rank; the ConfigMap is where the image reads node.yaml."""
    docs = render(overlay)
    sts, svc = one(docs, "StatefulSet"), one(docs, "Service")
    cfg = node_config(docs, tmp_path)
    name, ns, svc_name = sts["metadata"]["name"], sts["metadata"]["namespace"], \
        svc["metadata"]["name"]
    replicas = sts["spec"]["replicas"]
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert sts["spec"]["serviceName"] == svc_name
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert cfg.peers == [f"{name}-{i}.{svc_name}.{ns}.svc:{ports['peer']['port']}"
                         for i in range(replicas)]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    daemon = container(sts, "decentd")
    named = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert {k: named[p["targetPort"]] for k, p in ports.items()} == {
        k: p["port"] for k, p in ports.items()}
    assert named["data"] == cfg.transport.data_port and named["metrics"] == cfg.metrics.port
    for var in ("DECENT_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    for i in range(replicas):
        monkeypatch.setattr(socket, "gethostname", lambda i=i: f"{name}-{i}")
        assert cfg.rank == "auto" and cfg.resolved_rank() == i
    assert cfg.listen_address() == f"0.0.0.0:{ports['peer']['port']}"
    assert cfg.exposure_error() is None and cfg.security.mode == "mtls"
    env_names = {e["name"] for c in sts["spec"]["template"]["spec"]["containers"]
                 for e in c.get("env", [])}
    assert not env_names & {"DECENT_RANK", "RANK", "SLURM_PROCID"}  # they would beat the ordinal
    image = load_image()
    config_flag = image.cmd[image.cmd.index("--config") + 1]
    assert daemon["args"] == image.cmd
    assert volume(sts, "config")["configMap"]["name"] == one(docs, "ConfigMap")["metadata"][
        "name"]
    assert f"{mount_path(daemon, 'config')}/node.yaml" == config_flag
    socket_dir = str(Path(yaml.safe_load(one(docs, "ConfigMap")["data"]["node.yaml"])
                          ["socket"]).parent)
    assert mount_path(daemon, "run") == mount_path(container(sts, "trainer"), "run") == \
        socket_dir == image.env["XDG_RUNTIME_DIR"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_memory_probes_and_resources(overlay: str, tmp_path: Path) -> None:
    """/dev/shm is a memory emptyDir of arena_bytes x workers_per_node in the trainer; decentd's
    memory limit holds its arenas, pool and early arrivals; both containers request resources;
    readiness and liveness run the image's healthcheck command."""
    docs = render(overlay)
    sts = one(docs, "StatefulSet")
    cfg = node_config(docs, tmp_path)
    shm = volume(sts, "shm")["emptyDir"]
    trainer, daemon = container(sts, "trainer"), container(sts, "decentd")
    assert shm["medium"] == "Memory" and mount_path(trainer, "shm") == "/dev/shm"
    assert quantity(shm["sizeLimit"]) == cfg.memory.arena_bytes * cfg.workers_per_node
    assert quantity(trainer["resources"]["limits"]["memory"]) >= quantity(shm["sizeLimit"])
    needs = (cfg.memory.arena_bytes * cfg.workers_per_node + cfg.memory.pool_bytes
             + cfg.memory.early_arrival_bytes)
    assert quantity(daemon["resources"]["limits"]["memory"]) >= needs
    for c in (trainer, daemon):
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    health = load_image().healthcheck
    assert health is not None
    for probe in ("readinessProbe", "livenessProbe"):
        assert daemon[probe]["exec"]["command"] == health.test
        assert daemon[probe]["timeoutSeconds"] >= 5
    gpus = trainer["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert gpus == (cfg.workers_per_node if overlay == "gpu" else None)
    assert trainer["resources"]["requests"].get("nvidia.com/gpu") == gpus
    tags = {c["image"] for c in [*sts["spec"]["template"]["spec"]["containers"],
                                 *sts["spec"]["template"]["spec"]["initContainers"]]}
    assert tags == {"decent:cuda" if overlay == "gpu" else "decent:cpu"}
    pod = sts["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == int(load_image().args["UID"])


def test_network_policy_and_disruption_budget(tmp_path: Path) -> None:
    """Only the peer and bulk-data ports are open between the pods (both ways), metrics only to
    the monitoring namespace, DNS out; the budget lets one pod go at a time."""
    docs = render("cpu")
    sts, policy, pdb = one(docs, "StatefulSet"), one(docs, "NetworkPolicy"), \
        one(docs, "PodDisruptionBudget")
    cfg = node_config(docs, tmp_path)
    pods = sts["spec"]["template"]["metadata"]["labels"]
    peer_port = int(cfg.peers[0].rsplit(":", 1)[1])
    peer_ports = [{"port": peer_port, "protocol": "TCP"},
                  {"port": cfg.transport.data_port, "protocol": "TCP"}]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pods.items()
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    peers_in, metrics_in = policy["spec"]["ingress"]
    assert peers_in["from"][0]["podSelector"]["matchLabels"].items() <= pods.items()
    assert peers_in["ports"] == peer_ports
    assert metrics_in["ports"] == [{"port": cfg.metrics.port, "protocol": "TCP"}]
    peers_out, dns_out = policy["spec"]["egress"]
    assert peers_out["to"][0]["podSelector"]["matchLabels"].items() <= pods.items()
    assert peers_out["ports"] == peer_ports
    assert {p["port"] for p in dns_out["ports"]} == {53}
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()


def test_init_container_gives_decentd_this_pods_certificate(tmp_path: Path) -> None:
    """Certificates made as the README says (`decentctl certs` with the ConfigMap's cluster id
    and DNS pattern), laid out as the Secret volume lays them out (mode 0440, which decentd
    refuses for a key), are copied by the init container's script into files decentd's TLS
    loader accepts for the pod's own rank, with the DNS name its peers dial."""
    docs = render("cpu")
    sts = one(docs, "StatefulSet")
    cfg = node_config(docs, tmp_path)
    pattern = yaml.safe_load(one(docs, "ConfigMap")["data"]["node.yaml"])["peers"]["dns_pattern"]
    certs = tmp_path / "certs"
    subprocess.run([str(Path(sys.executable).parent / "decentctl"), "certs", "--out", str(certs),
                    "--nodes", str(len(cfg.peers)), "--cluster-id", cfg.cluster_id,
                    "--dns-pattern", pattern.rsplit(":", 1)[0]], check=True,
                   capture_output=True)
    secret = tmp_path / "secret"  # the Secret volume: every file but the CA key, defaultMode
    secret.mkdir()
    mode = volume(sts, "tls")["secret"]["defaultMode"]
    for f in certs.iterdir():
        if f.name != "ca.key":
            (secret / f.name).write_bytes(f.read_bytes())
            (secret / f.name).chmod(mode)
    with pytest.raises(ValueError, match="readable by others"):
        Tls.load(str(secret / "ca.crt"), str(secret / "node-1.crt"), str(secret / "node-1.key"),
                 True)
    (init,) = sts["spec"]["template"]["spec"]["initContainers"]
    out = tmp_path / "credentials"
    out.mkdir()
    script = init["args"][0].replace(mount_path(init, "tls"), str(secret)).replace(
        mount_path(init, "credentials"), str(out))
    subprocess.run([*init["command"], script], env={"HOSTNAME": f"{sts['metadata']['name']}-1",
                                                    "PATH": "/usr/bin:/bin"}, check=True)
    daemon = container(sts, "decentd")
    assert mount_path(daemon, "credentials") == str(Path(cfg.security.key or "").parent)
    local = {k: str(out / Path(getattr(cfg.security, k) or "").name) for k in ("ca", "cert",
                                                                                "key")}
    assert stat.S_IMODE(Path(local["key"]).stat().st_mode) == 0o600
    tls = Tls.load(local["ca"], local["cert"], local["key"], cfg.security.encrypt_bulk)
    assert tls.identity() == (cfg.cluster_id, 1)
    sans = x509.load_pem_x509_certificate(tls.cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert cfg.peers[1].rsplit(":", 1)[0] in sans
