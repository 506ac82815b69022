"""Stand-ins for SLURM's ``scontrol`` and ``srun``, for the test of deploy/slurm/decent.sbatch.

``python fake_slurm.py scontrol show hostnames LIST`` expands a SLURM hostlist
(``node[0-3,7]``, ``a,b``, zero-padded ranges) one name a line, as scontrol does.

``python fake_slurm.py srun [options] COMMAND...`` appends what it was asked (its arguments, as
JSON) to ``$FAKE_SLURM_LOG``, then runs COMMAND as the step's tasks, block-distributed over the
first ``--nodes`` hosts of ``$SLURM_JOB_NODELIST`` with the variables srun gives each task
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURMD_NODENAME``, ``SLURM_STEP_ID``,
...). ``$FAKE_SLURM_HOSTS`` (JSON ``{host: argv prefix}``) runs each host's tasks under that
prefix (its network namespace); without it they run here. Like srun, it forwards SIGTERM and
SIGINT to the tasks, ends the others when one fails with ``--kill-on-bad-exit``, and exits with
the highest exit code of the tasks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from types import FrameType


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a SLURM hostlist expression."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)", hostlist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


def scontrol(args: list[str]) -> int:
    """``scontrol show hostnames LIST`` (the only form the script uses)."""
    if args[:2] != ["show", "hostnames"] or len(args) != 3:
        print(f"fake scontrol: unsupported {args}", file=sys.stderr)
        return 1
    print("\n".join(expand_hostlist(args[2])))
    return 0


def parse_srun(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """srun's options (``--name=value``, ``--flag``) and the command after them."""
    options: dict[str, str] = {}
    while args and args[0].startswith("-"):
        name, sep, value = args.pop(0).lstrip("-").partition("=")
        options[name] = value if sep else "1"
    return options, args


def srun(args: list[str]) -> int:
    """Run one job step (see the module's docstring)."""
    options, command = parse_srun(list(args))
    with open(os.environ["FAKE_SLURM_LOG"], "a+") as log:
        log.seek(0)
        step = len(log.readlines())
        log.write(json.dumps({"options": options, "command": command}) + "\n")
    hosts = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])[:int(options["nodes"])]
    per_node = int(options["ntasks-per-node"])
    ntasks = int(options.get("ntasks", len(hosts) * per_node))
    assert ntasks == len(hosts) * per_node, f"{ntasks} tasks on {len(hosts)} x {per_node}"
    prefixes: dict[str, list[str]] = json.loads(os.environ.get("FAKE_SLURM_HOSTS", "{}"))
    tasks: list[subprocess.Popen[bytes]] = []
    for node_id, host in enumerate(hosts):
        for local in range(per_node):
            env = {**os.environ, "SLURM_PROCID": str(node_id * per_node + local),
                   "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node_id),
                   "SLURMD_NODENAME": host, "SLURM_STEP_ID": str(step),
                   "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NUM_NODES": str(len(hosts)),
                   "SLURM_STEP_NODELIST": ",".join(hosts), "SLURM_NTASKS": str(ntasks)}
            tasks.append(subprocess.Popen([*prefixes.get(host, []), *command], env=env))

    def forward(signum: int, _frame: FrameType | None) -> None:
        for t in tasks:
            if t.poll() is None:
                t.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(t.poll() is None for t in tasks):
        if options.get("kill-on-bad-exit") == "1" and any(t.poll() for t in tasks):
            forward(signal.SIGKILL, None)
        time.sleep(0.05)
    return max(t.returncode if t.returncode >= 0 else 128 - t.returncode for t in tasks)


if __name__ == "__main__":
    tool, *rest = sys.argv[1:]
    sys.exit(scontrol(rest) if tool == "scontrol" else srun(rest))
