#!/usr/bin/env bash
# Runs specchat's test suite in ./.venv, installing what the tests need first.
# Usage: bash packaging/test.sh [pytest arguments]
# Without arguments: two passes, the tests that can share the machine on every core at once
# (pytest-xdist), then the browser tests and those marked `alone`, one at a time, since they time
# the app or start processes that need the cores. With arguments: one pytest run with them.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/specchat ] || bash packaging/install.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# The browser test drives Debian's Chromium (never `playwright install`, which downloads a browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
together=0
.venv/bin/python -m pytest -n auto -m "not browser and not alone" || together=$?
alone=0
.venv/bin/python -m pytest -p no:xdist -m "browser or alone" || alone=$?
echo "test.sh: parallel pass exit $together, one-at-a-time pass exit $alone"
[ "$together" = 0 ] && [ "$alone" = 0 ]
