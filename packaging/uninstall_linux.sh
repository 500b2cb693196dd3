#!/usr/bin/env bash
# Double-click to uninstall specchat: removes installer_files/ (environment, Python, caches) and
# the shortcuts; this folder's own files and your conversations stay. See packaging/unix/launcher.sh.
# Reached through a symlink (a desktop shortcut made by an older launcher, or by hand), find the
# real file: its folder holds unix/launcher.sh. (No readlink -f: older macOS lacks it.)
self=$0 hops=0
while [ -L "$self" ] && [ $hops -lt 40 ]; do
    link=$(readlink "$self")
    case $link in /*) self=$link ;; *) self=$(dirname "$self")/$link ;; esac
    hops=$((hops + 1))
done
exec bash "$(dirname "$self")/unix/launcher.sh" uninstall "$@"
