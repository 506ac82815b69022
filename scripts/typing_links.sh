#!/usr/bin/env bash
# mypy finds modules by their import names; the tree keeps them under wire/, daemon/ and clients/
# (pyproject's package-dir). These links give mypy the same mapping the install gives Python.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/typing
ln -sfn ../../wire build/typing/decent_wire
ln -sfn ../../daemon build/typing/decentd
ln -sfn ../../clients build/typing/decent
