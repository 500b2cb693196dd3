#!/usr/bin/env bash
# Runs specchat's test suite in ./.venv, installing what the tests need first.
# Usage: bash packaging/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/specchat ] || bash packaging/install.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# The browser test drives Debian's Chromium (never `playwright install`, which downloads a browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
