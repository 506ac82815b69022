"""What ``deploy/docker/Dockerfile`` builds, read from the file with BuildKit's own parser (the
``dockerfile`` package): its stages, build arguments, and the final image's config (user,
environment, working directory, entrypoint, command, healthcheck, copied paths).

The Docker test checks these; the compose test runs containers "of this image" as processes, so
it takes the image's entrypoint, environment and healthcheck from here rather than from a copy.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile  # type: ignore[import-not-found]  # a compiled module, no stubs

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
#: PATH in the base images (Debian's python image and NVIDIA's CUDA image both start with it)
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand(text: str, values: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced from ``values`` (unknown names: empty, as Docker)."""
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(2), ""), text)


@dataclass
class Stage:
    """One ``FROM ... AS name`` stage and its instructions."""

    name: str
    base: str  # the FROM argument, variables expanded
    commands: list[dockerfile.Command] = field(default_factory=list)


@dataclass
class Healthcheck:
    """A HEALTHCHECK: the command (exec form) and its timing flags."""

    test: list[str]
    flags: dict[str, str]


@dataclass
class Image:
    """The Dockerfile read as BuildKit would build it with the given build arguments."""

    global_args: dict[str, str]
    stages: list[Stage]
    final: Stage
    #: the final stage's resolved config
    env: dict[str, str]
    user: str
    workdir: str
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: Healthcheck | None
    #: (source in the build context or ``--from`` stage, destination) of the final image
    copies: list[tuple[str, str, str | None]]
    #: the ARGs the final stage saw, resolved
    args: dict[str, str]

    def stage(self, name: str) -> Stage:
        """The stage called ``name`` (KeyError if there is none)."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def chain(self, stage: Stage) -> list[Stage]:
        """``stage`` and the stages it is built FROM, base first."""
        names = {s.name: s for s in self.stages}
        out = [stage]
        while out[0].base in names:
            out.insert(0, names[out[0].base])
        return out


def _arg(value: str, known: dict[str, str]) -> tuple[str, str | None]:
    name, sep, default = value.partition("=")
    return name, expand(default, known) if sep else None


def load(path: Path = DOCKERFILE, build_args: dict[str, str] | None = None) -> Image:
    """Parse ``path`` and resolve the final stage's config (``build_args`` as ``--build-arg``)."""
    build_args = build_args or {}
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for cmd in dockerfile.parse_file(str(path)):
        if cmd.cmd == "FROM":
            name = cmd.value[2] if len(cmd.value) > 2 else f"stage{len(stages)}"
            stages.append(Stage(name, expand(cmd.value[0], global_args)))
        elif not stages:
            if cmd.cmd == "ARG":
                name, default = _arg(cmd.value[0], global_args)
                global_args[name] = build_args.get(name, default or "")
        else:
            stages[-1].commands.append(cmd)
    image = Image(global_args, stages, stages[-1], {}, "root", "/", [], [], None, [], {})
    for stage in image.chain(image.final):
        _apply(image, stage, build_args)
    return image


def _apply(image: Image, stage: Stage, build_args: dict[str, str]) -> None:
    """Apply one stage's config instructions to ``image`` (later stages override)."""
    args: dict[str, str] = {}
    for cmd in stage.commands:
        scope = {**args, **image.env}
        if cmd.cmd == "ARG":
            name, default = _arg(cmd.value[0], scope)
            if default is None:  # `ARG NAME` in a stage: the global default
                default = image.global_args.get(name, "")
            args[name] = build_args.get(name, default)
        elif cmd.cmd == "ENV":
            pairs = list(zip(cmd.value[::2], cmd.value[1::2], strict=True))
            for key, value in pairs:
                image.env[key] = expand(value, {"PATH": BASE_PATH, **scope})
        elif cmd.cmd == "USER":
            image.user = expand(cmd.value[0], scope)
        elif cmd.cmd == "WORKDIR":
            image.workdir = expand(cmd.value[0], scope)
        elif cmd.cmd == "ENTRYPOINT":
            image.entrypoint = list(cmd.value) if cmd.json else ["/bin/sh", "-c", cmd.value[0]]
            image.cmd = []  # a new ENTRYPOINT resets CMD
        elif cmd.cmd == "CMD":
            image.cmd = list(cmd.value) if cmd.json else ["/bin/sh", "-c", cmd.value[0]]
        elif cmd.cmd == "HEALTHCHECK":
            kind, *test = cmd.value
            flags = dict(f.lstrip("-").split("=", 1) for f in cmd.flags)
            if kind == "CMD" and not cmd.json:
                test = ["/bin/sh", "-c", " ".join(test)]
            image.healthcheck = Healthcheck(test, flags) if kind == "CMD" else None
        elif cmd.cmd == "COPY" and stage is image.final:
            src = [f.split("=", 1)[1] for f in cmd.flags if f.startswith("--from=")]
            *sources, dest = cmd.value
            for source in sources:
                image.copies.append((source, dest, src[0] if src else None))
    if stage is image.final:
        image.args = args


def run_lines(stage: Stage) -> list[str]:
    """The shell text of every RUN of ``stage``."""
    return [" ".join(c.value) for c in stage.commands if c.cmd == "RUN"]


def words(stage: Stage) -> list[list[str]]:
    """Every RUN of ``stage`` split into words (as sh would, quotes removed)."""
    return [shlex.split(line.replace("\\\n", " ")) for line in run_lines(stage)]


def seconds(duration: str) -> float:
    """A Docker/Compose duration (``30s``, ``1m30s``, ``500ms``) in seconds."""
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)(ms|us|s|m|h)", duration):
        total += float(number) * {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
    return total
