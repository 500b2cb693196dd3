"""Waits until the chat a launcher started can answer, then prints how long the person waited.

Usage (by the launchers, beside `specchat ARGS`, in specchat's environment):
    python ready.py STARTED INSTALL_SECONDS LOG -- ARGS
    python ready.py --running [--record FILE --pid PID] -- ARGS
STARTED is the epoch time the launcher started (the double-click), INSTALL_SECONDS how much of
the wait was installing. `GET /v1/models` answers only once the model is loaded, so its first
answer marks a usable chat. Exits quietly when ARGS start no server, or when the launcher is gone.

--running exits 0 (and opens the page) when specchat already serves there, else 1: the launcher
then starts it. With --record, FILE (in installer_files) says which launcher (PID) is starting or
running the chat and at which address: a second double-click while the first chat still starts
waits for it to answer and opens it, instead of starting another server on the same port. A
record whose launcher is gone is stale and ignored; the launcher removes its own when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import urllib.error
import urllib.request

DEADLINE_SECONDS = 1800  # a first start on a slow machine converts the model: give up only much later
# The server is on this computer: never ask it through a proxy set in the environment.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_url(args: list[str]) -> tuple[str, str | None] | None:
    """(base URL, API key) of the server `specchat ARGS` starts, or None when ARGS run a subcommand."""
    if args and not args[0].startswith("-") and args[0] != "ui":
        return None
    if "-h" in args or "--help" in args:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--api-key", default=os.environ.get("SPECCHAT_API_KEY"))
    known, _ = parser.parse_known_args(args[1:] if args and args[0] == "ui" else args)
    host = "127.0.0.1" if known.host in ("0.0.0.0", "::", "") else known.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{known.port}", known.api_key


def answers(url: str, api_key: str | None) -> bool:
    request = urllib.request.Request(f"{url}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with OPENER.open(request, timeout=10) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def already_running(url: str) -> bool:
    """Whether specchat's page answers at `url` (a second double-click while the chat runs)."""
    try:
        with OPENER.open(f"{url}/", timeout=3) as response:
            page = response.read(5_000_000)
    except (urllib.error.URLError, OSError, ValueError):
        return False
    # Gradio renders the title in the browser; the page carries it in its embedded config.
    return b'"title":"specchat"' in page or b"<title>specchat</title>" in page


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process `pid` exists (and, on Windows, which reuses ids soon, was started before
    the epoch time `since`). Not os.kill(pid, 0): on Windows that would end the process."""
    if pid <= 0:
        return False
    if os.name == "nt":
        import ctypes
        from ctypes import wintypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        kernel32.OpenProcess.restype = wintypes.HANDLE
        kernel32.OpenProcess.argtypes = [wintypes.DWORD, wintypes.BOOL, wintypes.DWORD]
        kernel32.GetExitCodeProcess.argtypes = [wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD)]
        kernel32.GetProcessTimes.argtypes = [wintypes.HANDLE] + [ctypes.POINTER(wintypes.FILETIME)] * 4
        kernel32.CloseHandle.argtypes = [wintypes.HANDLE]
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return ctypes.get_last_error() == 5  # access denied: it exists
        try:
            code = wintypes.DWORD()
            if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)) or code.value != 259:  # STILL_ACTIVE
                return False
            times = [wintypes.FILETIME() for _ in range(4)]
            if since is not None and kernel32.GetProcessTimes(handle, *map(ctypes.byref, times)):
                created = ((times[0].dwHighDateTime << 32) + times[0].dwLowDateTime - 116444736000000000) / 1e7
                return created <= since + 1
            return True
        finally:
            kernel32.CloseHandle(handle)
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's
    except OSError:
        return False
    return True


def claim(record: str, pid: int, url: str) -> bool:
    """Write the record if there is none (atomically): whether this launcher now holds it, or
    may start the chat anyway (a record it cannot write holds nothing back)."""
    try:
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(f"{pid}\n{url}\n")
    return True


def read_record(record: str) -> tuple[int, str] | None:
    """(launcher's pid, URL) of the record; None when it is gone, or empty (being written)."""
    try:
        with open(record, encoding="utf-8") as file:
            lines = file.read().split("\n")
        return int(lines[0]), lines[1]
    except (OSError, ValueError, IndexError):
        return None


def forget(record: str, seen: tuple[int, str] | None) -> None:
    """Remove a stale record, unless another launcher has just replaced it."""
    if read_record(record) == seen:
        with contextlib.suppress(OSError):
            os.remove(record)


def wait_for_another_start(record: str, pid: int, url: str) -> bool:
    """Claim the record, or wait while the launcher that holds it starts the chat at `url`:
    True once that chat answers, False when this launcher should start the chat itself."""
    said = False
    deadline = time.time() + DEADLINE_SECONDS
    while time.time() < deadline:
        if claim(record, pid, url):
            return False
        holder = read_record(record)
        if holder is None:
            try:
                fresh = time.time() - os.stat(record).st_mtime < 5
            except OSError:
                continue  # gone: claim it
            if not fresh:  # its launcher ended before writing it
                forget(record, None)
            time.sleep(0.2)
            continue
        try:
            written = os.stat(record).st_mtime
        except OSError:
            continue
        if not pid_alive(holder[0], since=written):
            forget(record, holder)
            continue
        if holder[1] != url:
            return False  # another chat, on another port: this one starts too
        if already_running(url):
            return True
        if not said:
            print(f"specchat is already starting in another window (process {holder[0]}): waiting until it "
                  f"answers at {url}/ ...", file=sys.stderr, flush=True)
            said = True
        time.sleep(1)
    return False


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--running":
        args, record, pid = argv[1:], None, os.getppid()
        while args[:1] in (["--record"], ["--pid"]) and len(args) > 1:
            if args[0] == "--record":
                record = args[1]
            else:
                pid = int(args[1])
            args = args[2:]
        args = args[1:] if args[:1] == ["--"] else args  # (Windows PowerShell may drop the --)
        target = server_url(args)
        if target is None:
            return 1
        if not already_running(target[0]):
            if record is None or not wait_for_another_start(record, pid, target[0]):
                return 1
        opened = False
        if "--no-browser" not in args:
            import webbrowser

            opened = webbrowser.open(f"{target[0]}/")
        print(f"specchat is already running at {target[0]}/{' (opened in the browser)' if opened else ''}.",
              file=sys.stderr)
        return 0
    started, install_seconds, log = float(argv[0]), float(argv[1]), argv[2]
    target = server_url(argv[4:] if len(argv) > 3 and argv[3] == "--" else argv[3:])
    if target is None:
        return 0
    launcher = os.getppid()
    while time.time() - started < DEADLINE_SECONDS:
        if os.getppid() != launcher:  # the launcher (and so the server) has stopped
            return 0
        if answers(*target):
            waited = time.time() - started
            line = (f"specchat: ready for chat at {target[0]}/ {waited:.1f} s after the launcher started "
                    f"(installing {install_seconds:.0f} s, starting {waited - install_seconds:.1f} s)")
            print(line, file=sys.stderr, flush=True)
            try:
                with open(log, "a", encoding="utf-8") as file:
                    file.write(line + "\n")
            except OSError:
                pass  # the timing is on screen; a log it cannot write is no reason to fail
            return 0
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
