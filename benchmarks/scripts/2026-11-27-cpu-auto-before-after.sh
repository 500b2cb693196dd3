#!/bin/bash
# The auto suite before and after a change, alternating old, new, old, new, each build in its own
# process. Set up first: `git worktree add /tmp/old REV`, then /tmp/oldpkg/specchat -> /tmp/old and
# /tmp/newpkg/specchat -> this checkout (symlinks), so PYTHONPATH picks the build.
cd /tmp/autobench
docs="/work/main/tests/data/documents/lgpl-2.1.txt /work/main/tests/data/documents/mpl-2.0.txt"
for round in 1 2; do
  for build in old new; do
    mkdir -p out-$build-$round
    (cd /tmp && PYTHONPATH=/tmp/${build}pkg timeout 1500 /work/main/.venv/bin/python -c "import sys; from specchat.app.cli import entry_point; sys.argv=['specchat']+sys.argv[1:]; entry_point()" bench --suite auto --documents $docs --repeats 1 --max-new-tokens 128 --out /tmp/autobench/out-$build-$round) > /tmp/autobench/$build-$round.log 2>&1
    echo "$build $round rc=$?" >> /tmp/autobench/done.txt
  done
done
