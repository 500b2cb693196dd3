"""Issue 40's loop check in the browser, the half `2026-11-28-cpu-preset-loops.py` leaves: the app
as a person uses it (`specchat --no-browser`, headless Chromium driven by the browser tests'
helpers), a new conversation per answer, the Summarize preset at its defaults (its question, its
sampling, the page's default answer limit), the seed typed in Settings, the document pasted; the
same four public documents of 2.9-5.9K tokens, seeds 0-2, the embedded model. An answer loops if
its tokens repeat a run of 12 tokens 3 times (core/repeats.py `repeat_end`); the answer is read
from the saved conversation (what the page showed, before Markdown), so one the preset's guard
ended counts as looping too. A screenshot of each answer goes to artifacts/.
Run: .venv/bin/python benchmarks/scripts/2026-11-28-browser-preset-loops.py > bench/2026-11-28-cpu-browser-preset-loops.json"""
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from live_server import running_specchat  # noqa: E402
from test_browser import (ARTIFACTS, CHROMIUM, answers, choose_preset, fill_until_kept, new_conversation,  # noqa: E402
                          open_accordion, open_page, paste_document, shot, stats, wait_until_finished)

from specchat.app.presets import PRESETS  # noqa: E402
from specchat.core import embedded  # noqa: E402
from specchat.core.repeats import repeat_end  # noqa: E402

DOCUMENTS = ["numpy-ma-readme.rst", "mpl-2.0.txt", "http-proxy-readme.md", "lgpl-2.1.txt"]
FOLDER = Path(__file__).resolve().parents[2] / "tests" / "data" / "documents"


def set_seed(page, seed: int) -> None:
    open_accordion(page, "Settings")
    fill_until_kept(page.locator("#seed textarea, #seed input").first, str(seed))
    open_accordion(page, "Settings")


def newest_answer(data_dir: Path) -> dict:
    """The last answer of the conversation saved last."""
    newest = max((data_dir / "conversations").glob("*.json"), key=lambda path: path.stat().st_mtime)
    return json.loads(newest.read_text())["messages"][-1]


def main() -> None:
    from playwright.sync_api import sync_playwright
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded.ensure_converted())
    ARTIFACTS.mkdir(exist_ok=True)
    rows, started = [], time.time()
    with tempfile.TemporaryDirectory(prefix="specchat-loops-") as folder, sync_playwright() as playwright, \
            running_specchat(data_dir=folder) as url:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = open_page(browser, url)
        for name in DOCUMENTS:
            for seed in range(3):
                new_conversation(page)
                choose_preset(page, PRESETS["summarize"])
                set_seed(page, seed)
                paste_document(page, (FOLDER / name).read_text())
                asked = time.time()
                page.locator("#send").click()
                wait_until_finished(page, lambda: answers(page).count() == 1, f"{name}, seed {seed}", timeout=900)
                shot(page, f"loops-{Path(name).stem}-seed{seed}")
                answer = newest_answer(Path(folder))
                ids = tokenizer.encode(answer["content"], add_special_tokens=False)
                end = repeat_end(ids)
                rows.append({"document": name, "seed": seed, "answer_tokens": len(ids),
                             "finish_reason": answer.get("finish_reason"), "loops": end is not None,
                             "repeat_ends_at": end, "seconds": round(time.time() - asked),
                             "figures_line": stats(page), "text_start": answer["content"][:200]})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        browser.close()
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": "CPU (2 cores, this VM), headless Chromium beside the app",
                      "model": "embedded SmolLM2-135M-Instruct", "preset": "summarize, its defaults",
                      "seeds": [0, 1, 2], "loop": "repeats a run of 12 tokens 3 times, not overlapping (core/repeats.py)",
                      "seconds": round(time.time() - started),
                      "summary": {"answers": len(rows), "looping": sum(r["loops"] for r in rows),
                                  "ended_on_their_own": sum(r["finish_reason"] == "stop" for r in rows),
                                  "stopped_by_the_guard": sum(r["finish_reason"] == "repeating" for r in rows)},
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
