#!/usr/bin/env bash
# Double-click to open specchat: the first run installs it into this folder (installer_files/),
# later runs start it at once. Arguments go on to specchat, e.g. --port 8000 --no-browser.
# SPECCHAT_UNATTENDED=1 installs without asking anything. See packaging/unix/launcher.sh.
exec bash "$(dirname "$0")/unix/launcher.sh" start "$@"
