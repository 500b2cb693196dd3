"""What the page costs the engine on a small machine: the same answers in headless Chromium from
two source trees of specchat (e.g. before and after a change to how the page streams), then the
same question through the API with no page, with the page open and idle, and with it closed.

Arms: the app (`specchat --no-browser`, the browser tests' helpers) runs from each tree in turn
(PYTHONPATH=TREE, where TREE/specchat is a `git archive` of a commit), shuffled per round; a new
conversation per answer, the Summarize preset with seed 0 and a 256-token limit, the document
pasted. Decode tok/s is the page's own figure (first new token to the last); CPU seconds of the
server and of every Chromium process are read over each answer. The page is polled once a second.
Run: .venv/bin/python benchmarks/scripts/2026-11-29-cpu-page-streaming.py A=/tmp/before,N=/tmp/after \
         > bench/2026-11-29-cpu-page-streaming.json"""
import json
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from live_server import specchat_process  # noqa: E402
from test_browser import (CHROMIUM, answers, choose_preset, fill_until_kept, new_conversation,  # noqa: E402
                          open_accordion, open_page, paste_document, set_max_new_tokens, stats)

from specchat.app.presets import PRESETS  # noqa: E402

DOCUMENTS = ["mpl-2.0.txt", "lgpl-2.1.txt"]
FOLDER = ROOT / "tests" / "data" / "documents"
ROUNDS, TOKENS, SEED = 2, 256, 0


def cpu_seconds(processes) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def chromium():
    return [p for p in psutil.process_iter(["name"]) if "chrom" in (p.info["name"] or "").lower()]


def answer_in_page(page, server, document: str) -> dict:
    new_conversation(page)
    choose_preset(page, PRESETS["summarize"])
    set_max_new_tokens(page, TOKENS)
    open_accordion(page, "Settings")
    fill_until_kept(page.locator("#seed textarea, #seed input").first, str(SEED))
    open_accordion(page, "Settings")
    paste_document(page, (FOLDER / document).read_text())
    time.sleep(3)  # the meter's count settles
    server_before, chromium_before, started = cpu_seconds([server]), cpu_seconds(chromium()), time.monotonic()
    page.locator("#send").click()
    while not (answers(page).count() == 1 and re.search(r"done|cut off|stopped", stats(page))):
        time.sleep(1.0)
        if time.monotonic() - started > 900:
            raise SystemExit(f"{document}: no answer after 900 s")
    line = stats(page)
    return {"document": document, "tok_s": float(re.search(r"([\d.]+) tok/s", line).group(1)),
            "first_token_s": float(re.search(r"first token after ([\d.]+) s", line).group(1)),
            "wall_s": round(time.monotonic() - started, 1),
            "server_cpu_s": round(cpu_seconds([server]) - server_before, 1),
            "chromium_cpu_s": round(cpu_seconds(chromium()) - chromium_before, 1), "figures_line": line}


def ask_api(url: str, document: str) -> dict:
    preset = PRESETS["summarize"]
    body = {"model": "embedded/SmolLM2-135M-Instruct", "max_tokens": TOKENS, "temperature": preset.temperature,
            "top_p": preset.top_p, "repetition_penalty": preset.repetition_penalty, "seed": SEED, "stream": False,
            "messages": [{"role": "system", "content": preset.system},
                         {"role": "user", "content": (FOLDER / document).read_text() + "\n\n" + preset.question}]}
    request = urllib.request.Request(url + "v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    figures = json.load(urllib.request.urlopen(request, timeout=900))["specchat"]["stats"]
    return {"tok_s": round(figures["tokens_per_second"], 1), "prefill_s": round(figures["prefill_seconds"], 1)}


def main() -> None:
    from playwright.sync_api import sync_playwright

    arms = dict(arm.split("=", 1) for arm in sys.argv[1].split(","))
    rows = []
    with sync_playwright() as playwright:
        for round_ in range(ROUNDS):
            for arm in random.Random(round_).sample(sorted(arms), len(arms)):
                with tempfile.TemporaryDirectory() as data, \
                        specchat_process(data_dir=data, env={"PYTHONPATH": arms[arm]}) as (url, process):
                    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
                    page = open_page(browser, url)
                    for document in DOCUMENTS:
                        rows.append({"round": round_, "arm": arm, **answer_in_page(page, psutil.Process(process.pid), document)})
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    browser.close()
        last = sorted(arms)[-1]
        idle = {"tree": last, "document": DOCUMENTS[-1]}
        with tempfile.TemporaryDirectory() as data, specchat_process(data_dir=data, env={"PYTHONPATH": arms[last]}) as (url, _):
            idle["no_page_first_read"] = ask_api(url, DOCUMENTS[-1])
            idle["no_page"] = ask_api(url, DOCUMENTS[-1])  # the prompt reused from here on
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = open_page(browser, url)
            time.sleep(5)
            idle["page_open_idle"] = ask_api(url, DOCUMENTS[-1])
            page.close()
            time.sleep(2)
            idle["page_closed"] = ask_api(url, DOCUMENTS[-1])
            browser.close()
        print(json.dumps(idle), file=sys.stderr, flush=True)
    medians = {arm: {document: statistics.median(r["tok_s"] for r in rows if r["arm"] == arm and r["document"] == document)
                     for document in DOCUMENTS} for arm in sorted(arms)}
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": "CPU (2 cores, this VM), headless Chromium beside the app",
                      "model": "embedded SmolLM2-135M-Instruct", "preset": f"summarize, seed {SEED}, {TOKENS}-token limit",
                      "arms": arms, "median_tok_s": medians, "rows": rows, "api_with_and_without_a_page": idle}, indent=1))


if __name__ == "__main__":
    main()
