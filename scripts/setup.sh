#!/usr/bin/env bash
# Sets up everything from nothing: a virtualenv in .venv with decent, torch (CPU) and dev tools.
# Re-running is cheap: it reinstalls only when pyproject.toml, setup.py or proto/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.decent-setup
want=$(cat pyproject.toml setup.py proto/decent/v1/*.proto | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f clients/decent/v1/decent_pb2.py ]; then
  exit 0
fi
echo "setting up .venv (first run takes a minute or two)"
.venv/bin/python -m pip install -q --upgrade pip
# the CPU build of torch first: a looser requirement would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[torch,dev]"
echo "$want" > "$stamp"
