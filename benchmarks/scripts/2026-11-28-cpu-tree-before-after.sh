#!/bin/bash
# Tree mode before (the prompt-lookup tree, 630f881, checked out at /tmp/old and imported through
# /tmp/oldpkg/specchat -> /tmp/old) and after (the suffix tree, this checkout), each a run of the
# auto suite with plain beside it; bench/2026-11-28-cpu-tree-before-after.json joins the two.
#   git worktree add /tmp/old 630f881 && mkdir -p /tmp/oldpkg && ln -sfn /tmp/old /tmp/oldpkg/specchat
set -e
DOCS="tests/data/documents/numpy-ma-readme.rst tests/data/documents/http-proxy-readme.md tests/data/documents/lgpl-2.1.txt"
ROOT=$(pwd)
(cd /tmp/old && PYTHONPATH=/tmp/oldpkg "$ROOT/.venv/bin/python" -c "from specchat.app.cli import entry_point; entry_point()" \
    bench --suite auto --documents $DOCS --max-new-tokens 128 --out /tmp/ab/old)
.venv/bin/specchat bench --suite auto --documents $DOCS --max-new-tokens 128 --out /tmp/ab/new
