#!/usr/bin/env bash
# Double-click to update specchat: pulls the new version (in a git checkout) and installs what it
# needs into this folder. See packaging/unix/launcher.sh.
exec bash "$(dirname "$0")/unix/launcher.sh" update "$@"
