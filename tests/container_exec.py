"""Start one "container" of the compose test: ``python container_exec.py SPEC.json``.

Run inside a fresh mount namespace (``unshare --mount``, as :mod:`deploy_netns` does), it
mounts what the container would see (volumes, bind mounts, the image's copied directories, its
/dev/shm: a list of ``[source, target, options]`` in the spec), changes to the
working directory and replaces itself with the container's command, with exactly the
container's environment. The mounts are gone with the namespace when the command exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def mount(source: str, target: str, options: str) -> None:
    """Bind ``source`` at ``target`` (``ro``: read-only)."""
    subprocess.run(["mount", "--bind", source, target], check=True)
    if options == "ro":
        subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)


def main(argv: list[str]) -> int:
    """Mount, chdir and exec as the spec at ``argv[1]`` says (never returns on success)."""
    with open(argv[1]) as f:
        spec = json.load(f)
    for source, target, options in spec["mounts"]:
        mount(source, target, options)
    os.chdir(spec["cwd"])
    command: list[str] = spec["argv"]
    sys.stdout.flush()
    os.execvpe(command[0], command, spec["env"])
    return 127  # pragma: no cover - execvpe does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv))
