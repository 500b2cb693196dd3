"""What an open, idle page costs: Chromium's CPU with the app's page open and nothing happening,
and the API's decode with no page and with the page open, from two source trees of specchat in
turn (PYTHONPATH=TREE, TREE/specchat a `git archive` of a commit), 2 rounds, the order reversed
in the second. The LGPL-2.1 with the Summarize preset through `/v1` (the prompt read once first).
Run: .venv/bin/python benchmarks/scripts/2026-11-30-cpu-idle-page.py A=/tmp/before,S=/tmp/after \
         > bench/2026-11-30-cpu-idle-page.json"""
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

# The page-streaming script's helpers (the server, the page, the API question, CPU readings).
_spec = importlib.util.spec_from_file_location("pagebench", Path(__file__).with_name("2026-11-29-cpu-page-streaming.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

arms = dict(a.split("=", 1) for a in sys.argv[1].split(","))
rows = []
with sync_playwright() as pw:
    for round_ in range(2):
        for arm in sorted(arms, reverse=bool(round_)):
            with tempfile.TemporaryDirectory() as data, bench.specchat_process(data_dir=data, env={"PYTHONPATH": arms[arm]}) as (url, _):
                row = {"round": round_, "arm": arm}
                bench.ask_api(url, "lgpl-2.1.txt")  # the first read
                row["no_page"] = bench.ask_api(url, "lgpl-2.1.txt")["tok_s"]
                browser = pw.chromium.launch(executable_path=bench.CHROMIUM, headless=True)
                page = bench.open_page(browser, url)
                time.sleep(8)
                before, started = bench.cpu_seconds(bench.chromium()), time.monotonic()
                time.sleep(20)
                row["chromium_idle_core_share"] = round((bench.cpu_seconds(bench.chromium()) - before) / (time.monotonic() - started), 3)
                row["page_open_idle"] = bench.ask_api(url, "lgpl-2.1.txt")["tok_s"]
                browser.close()
                rows.append(row); print(json.dumps(row), file=sys.stderr, flush=True)
print(json.dumps({"date": time.strftime("%Y-%m-%d"), "arms": arms, "rows": rows}, indent=1))
