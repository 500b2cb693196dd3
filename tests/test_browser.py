"""End to end in a real browser: `specchat --no-browser` serves the chat; headless Chromium
(Debian's, driven by playwright; never `playwright install`) sends messages and watches the
answer stream in. Screenshots land in artifacts/ (git-ignored)."""

import os
import time
from pathlib import Path

import pytest
from conftest import DATA
from live_server import running_specchat

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent.parent / "artifacts"
pytestmark = [pytest.mark.browser, pytest.mark.slow]


def browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = "playwright is not installed" if sync_playwright is None else (
        None if os.path.exists(CHROMIUM) else f"{CHROMIUM} is missing (apt-get install chromium)")
    if missing:
        if os.environ.get("SPECCHAT_REQUIRE_BROWSER"):
            pytest.fail(missing)
        pytest.skip(missing)
    return sync_playwright


@pytest.fixture(scope="module")
def server(embedded_dir):
    with running_specchat() as url:
        yield url


@pytest.fixture(scope="module")
def page(server):
    sync_playwright = browser_or_skip()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1100, "height": 1000})
        # Never wait for "networkidle": Gradio keeps a connection open.
        page.goto(server)
        page.locator("#message textarea").wait_for(timeout=60_000)
        yield page
        browser.close()


def wait_for(condition, timeout=120, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def send(page, text):
    box = page.locator("#message textarea")
    box.fill(text)
    box.press("Enter")


def last_answer(page) -> str:
    bots = page.locator('[data-testid="bot"]')
    return bots.last.inner_text() if bots.count() else ""


def test_answer_streams_in_and_stop_stops_it(page):
    send(page, "Write a long story about a dragon who loves books.")
    lengths = set()
    wait_for(lambda: lengths.add(len(last_answer(page))) or len(lengths - {0}) >= 3,
             what="the answer to grow over several updates")
    page.locator("#stop").click()
    stopped = wait_for(lambda: _settled(page), what="the answer to stop")
    stats = page.locator("#stats").inner_text()
    # Stopped, not finished on its own: live figures, but no end-of-answer marker.
    assert "tok/s" in stats and "done" not in stats and "token limit" not in stats
    page.screenshot(path=str(ARTIFACTS / "browser-streaming-stopped.png"), full_page=True)
    time.sleep(2)
    assert last_answer(page) == stopped  # nothing more arrives after Stop


def _settled(page):
    before = last_answer(page)
    time.sleep(1.5)
    after = last_answer(page)
    return after if after and after == before else None


def test_question_about_a_pasted_document(page):
    page.get_by_text("New conversation").click()
    page.get_by_text("Document", exact=True).click()
    notes = ("Meeting notes. The launch date moved to March 3. Budget approved: 40,000 euros. "
             "Owner of the launch: Priya.")
    document = page.locator("#document textarea")
    # The accordion mounts its content as it opens and may reset a value typed too early:
    # type until the value sticks, as a person (slower than a script) always sees it.
    wait_for(lambda: document.fill(notes) or time.sleep(0.5) or document.input_value() == notes,
             timeout=15, what="the document box to keep its text")
    send(page, "Who owns the launch?")
    wait_for(lambda: "done" in page.locator("#stats").inner_text()
             or "token limit" in page.locator("#stats").inner_text(), what="the answer to finish")
    user_turns = page.locator('[data-testid="user"]')
    assert user_turns.count() == 1 and "document attached" in user_turns.last.inner_text()
    assert last_answer(page).strip()
    assert page.locator("#document textarea").input_value() == ""  # sent once, now in the conversation
    page.screenshot(path=str(ARTIFACTS / "browser-document-answer.png"), full_page=True)


def test_a_document_too_long_is_refused_and_nothing_is_lost(page):
    before = page.locator('[data-testid="user"]').count()
    answer_before = last_answer(page)
    too_long = (DATA / "gpl-3.0.txt").read_text() * 2  # about 15K tokens; the context is 8K
    document = page.locator("#document textarea")
    wait_for(lambda: document.fill(too_long) or time.sleep(0.5) or document.input_value() == too_long,
             timeout=15, what="the document box to keep its text")
    send(page, "Summarize this.")
    wait_for(lambda: "shorten" in page.locator("#stats").inner_text(), what="the error message")
    assert page.locator('[data-testid="user"]').count() == before  # the chat is as it was
    assert last_answer(page) == answer_before
    assert document.input_value() == too_long  # the document is still there to fix
    assert page.locator("#message textarea").input_value() == "Summarize this."
    page.screenshot(path=str(ARTIFACTS / "browser-document-too-long.png"), full_page=True)
