"""Issue 40's first launch: `specchat` (the README's launch command, after the install) with
empty caches and config, a first question through the API as soon as the server takes one, then
idle time for the calibration the app runs between answers, a second question, Ctrl-C. Prints the
seconds to each answer and every line the terminal showed.
Run: .venv/bin/python benchmarks/scripts/2026-11-28-cpu-first-launch.py > bench/2026-11-28-cpu-first-launch.json"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PORT = 7871
URL = f"http://127.0.0.1:{PORT}/v1"
IDLE_SECONDS = 420  # room for the whole calibration (about three minutes on a quiet 2-core CPU)


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(URL + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def model_id() -> str:
    while True:
        try:
            with urllib.request.urlopen(URL + "/models", timeout=600) as response:
                return json.load(response)["data"][0]["id"]
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)  # the server is not listening yet


def ask(question: str) -> tuple[float, str]:
    started = time.monotonic()
    reply = post("/chat/completions", {"model": model_id(), "max_tokens": 32,
                                       "messages": [{"role": "user", "content": question}]})
    return time.monotonic() - started, reply["choices"][0]["message"]["content"]


home = Path(tempfile.mkdtemp(prefix="specchat-first-launch-"))
env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"), "XDG_DATA_HOME": str(home / "data"),
       "XDG_CONFIG_HOME": str(home / "config"), "HF_HOME": str(home / "hf")}
env.pop("SPECCHAT_CACHE_DIR", None)
env.pop("SPECCHAT_CALIBRATE", None)
env.pop("SPECCHAT_DATA_DIR", None)
log = (home / "terminal.txt").open("w")
launched = time.monotonic()
server = subprocess.Popen([str(Path(sys.executable).parent / "specchat"), "--no-browser", "--port", str(PORT)],
                          stdout=log, stderr=subprocess.STDOUT, env=env)
try:
    first_text = ask("Hello! Who are you?")[1]
    first_seconds = time.monotonic() - launched
    print(f"first answer after {first_seconds:.1f} s", file=sys.stderr, flush=True)
    curves = home / "cache" / "specchat" / "hardware"
    idle_started = time.monotonic()
    while time.monotonic() - idle_started < IDLE_SECONDS and not list(curves.glob("*/curves/*.json")):
        time.sleep(1)
    calibrated_after = round(time.monotonic() - idle_started) if list(curves.glob("*/curves/*.json")) else None
    second_seconds, second_text = ask("Name three colours.")
finally:
    server.send_signal(signal.SIGINT)
    server.wait(60)
    log.close()
lines = (home / "terminal.txt").read_text().splitlines()
print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": "CPU (2 cores, this VM, shared with other work)",
                  "command": f"specchat --no-browser --port {PORT} (empty caches and config)",
                  "first_answer_seconds_after_launch": round(first_seconds, 1), "first_answer": first_text,
                  "calibration_done_seconds_after_first_answer": calibrated_after,
                  "second_answer_seconds": round(second_seconds, 1), "terminal_lines": len(lines), "terminal": lines},
                 indent=1))
