"""Waits until the chat a launcher started can answer, then prints how long the person waited.

Usage (by the launchers, beside `specchat ARGS`, in specchat's environment):
    python ready.py STARTED INSTALL_SECONDS LOG -- ARGS
    python ready.py --running -- ARGS    exit 0 (and open the page) when specchat already serves there
STARTED is the epoch time the launcher started (the double-click), INSTALL_SECONDS how much of
the wait was installing. `GET /v1/models` answers only once the model is loaded, so its first
answer marks a usable chat. Exits quietly when ARGS start no server, or when the launcher is gone.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--running":
        target = server_url(argv[2:] if argv[1:2] == ["--"] else argv[1:])
        if target is None or not already_running(target[0]):
            return 1
        opened = False
        if "--no-browser" not in argv:
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
