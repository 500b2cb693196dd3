#!/usr/bin/env bash
# Double-click to uninstall specchat: removes installer_files/ (environment, Python, caches) and
# the shortcuts; this folder's own files and your conversations stay. See packaging/unix/launcher.sh.
exec bash "$(dirname "$0")/unix/launcher.sh" uninstall "$@"
