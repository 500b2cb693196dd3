"""End to end in a real browser: `specchat --no-browser` serves the app; headless Chromium
(Debian's, driven by playwright; never `playwright install`) uses it as a person would. Every
flow leaves a screenshot in artifacts/ (git-ignored, kept by CI as test artifacts)."""

import os
import re
import time
from pathlib import Path

import pytest
from conftest import DATA
from live_server import running_specchat, specchat_process
from pdf_fixture import write_pdf
from specchat.app.presets import PRESETS

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent.parent / "artifacts"
FINISHED = re.compile(r"done|token limit")
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
def playwright_browser():
    sync_playwright = browser_or_skip()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1200, "height": 1100})
    page.goto(url)  # never wait for "networkidle": Gradio keeps a connection open
    page.locator("#message textarea").wait_for(timeout=60_000)
    return page


@pytest.fixture(scope="module")
def page(embedded_dir, playwright_browser):
    with running_specchat() as url:
        page = open_page(playwright_browser, url)
        yield page
        page.close()


def shot(page, name):
    # Generous: on a busy 2-core machine a full-page capture can take many seconds.
    page.screenshot(path=str(ARTIFACTS / f"browser-{name}.png"), full_page=True, timeout=120_000)


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


def answers(page):
    return page.locator('[data-testid="bot"]')


def questions(page):
    return page.locator('[data-testid="user"]')


def last_answer(page) -> str:
    bots = answers(page)
    return bots.last.inner_text() if bots.count() else ""


def stats(page) -> str:
    return page.locator("#stats").inner_text()


def wait_until_finished(page, new_answer, what="the answer to finish"):
    """Until `new_answer()` holds (the page shows the answer waited for, not an earlier one) and
    the figures line marks its end, unchanged for half a second."""
    def finished():
        text = stats(page)
        return new_answer() and FINISHED.search(text) and time.sleep(0.5) is None and stats(page) == text
    wait_for(finished, what=what)


def open_accordion(page, label):
    page.get_by_text(label, exact=True).click()


def fill_until_kept(box, text):
    # An accordion mounts its content as it opens and may reset a value typed too early:
    # type until the value sticks, as a person (slower than a script) always sees it.
    wait_for(lambda: box.fill(text) or time.sleep(0.5) or box.input_value() == text,
             timeout=15, what="the box to keep its text")


def set_max_new_tokens(page, count):
    open_accordion(page, "Settings")
    number = page.locator("#max-new-tokens input[type=number]")
    fill_until_kept(number, str(count))
    number.press("Enter")
    open_accordion(page, "Settings")


def _settled(page):
    before = last_answer(page)
    time.sleep(1.5)
    after = last_answer(page)
    return after if after and after == before else None


def test_answer_streams_in_and_stop_stops_it(page):
    send(page, "Write a long story about a dragon who loves books.")
    lengths = set()
    wait_for(lambda: lengths.add(len(last_answer(page))) or len(lengths - {0}) >= 3,
             what="the answer to grow over several updates")
    page.locator("#stop").click()
    stopped = wait_for(lambda: _settled(page), what="the answer to stop")
    wait_for(lambda: "stopped" in page.locator("#stats").inner_text(), what="the stopped marker")
    assert "tok/s" in page.locator("#stats").inner_text()
    shot(page, "streaming-stopped")
    time.sleep(2)
    assert last_answer(page) == stopped  # nothing more arrives after Stop


def test_regenerate_replaces_the_last_answer(page):
    set_max_new_tokens(page, 48)
    page.get_by_label("Retry").last.click()  # the stopped answer's figures say "stopped", never "done"
    wait_until_finished(page, lambda: True, "the regenerated answer")
    assert questions(page).count() == 1 and answers(page).count() == 1
    assert last_answer(page).strip()
    shot(page, "regenerated")


def test_edit_and_resend(page):
    old_answer = last_answer(page)
    edit = page.get_by_label("Edit").last
    wait_for(lambda: questions(page).last.hover() or edit.is_enabled(), what="editing to be possible")
    edit.click()
    editor = page.locator("#chat textarea").last
    editor.wait_for(timeout=10_000)
    editor.fill("Name three colors. Use **bold** for each.")
    page.locator('#chat button[aria-label="Submit"]').click()
    wait_until_finished(page, lambda: last_answer(page) != old_answer, "the answer to the edited question")
    assert "three colors" in questions(page).last.inner_text()
    assert questions(page).count() == 1 and answers(page).count() == 1
    assert questions(page).last.locator("strong").count() >= 1  # Markdown is rendered
    shot(page, "edited")


def test_speculation_view_colors_tokens_by_origin(page):
    open_accordion(page, "Speculation view")
    page.locator("#color-tokens input").check()
    tokens = page.locator("#tokens")
    wait_for(lambda: tokens.locator("span[class^=tok-]").count() > 3, what="colored tokens")
    assert "target (full verification)" in page.locator("#stages").inner_text()
    shot(page, "speculation-view")
    open_accordion(page, "Speculation view")


def test_upload_a_pdf_and_summarize_it(page, tmp_path):
    page.locator("#new-conversation").click()
    wait_for(lambda: answers(page).count() == 0, what="an empty chat")
    pdf = tmp_path / "launch-report.pdf"
    write_pdf(pdf, ["Launch report. The launch date moved to March 3.",
                    "Budget approved: 40,000 euros. Owner of the launch: Priya."])
    open_accordion(page, "Document")
    page.locator("#upload input[type=file]").set_input_files(str(pdf))
    wait_for(lambda: "launch-report.pdf" in page.locator("#attachment").inner_text(), what="the attachment")
    assert "tokens" in page.locator("#attachment").inner_text()
    page.locator("#preset input").click()
    page.get_by_role("option", name="Summarize the document").click()
    wait_for(lambda: page.locator("#message textarea").input_value() == "Summarize this document.",
             what="the preset's question")
    page.locator("#send").click()
    wait_until_finished(page, lambda: answers(page).count() == 1, "the summary")
    assert "launch-report.pdf" in questions(page).last.inner_text()
    assert last_answer(page).strip()
    assert page.locator("#attachment").inner_text().strip() == ""  # sent once, now in the conversation
    shot(page, "pdf-summary")


def test_over_the_limit_offers_a_choice_and_cuts_only_when_asked(page):
    set_max_new_tokens(page, 16)  # the prefill of ~8K tokens is what this flow is about
    before_questions, before_answer = questions(page).count(), last_answer(page)
    too_long = (DATA / "gpl-3.0.txt").read_text() + (DATA / "apache-2.0.txt").read_text()[:4000]  # ~8.6K tokens; the context is 8K
    fill_until_kept(page.locator("#document textarea"), too_long)
    wait_for(lambda: "over the limit" in page.locator("#meter").inner_text(), what="the meter to warn")
    send(page, "What is this license about?")
    choice = page.locator("#over-limit").first
    wait_for(choice.is_visible, what="the over-limit choice")
    assert "Cut the middle" in choice.inner_text()
    assert questions(page).count() == before_questions and last_answer(page) == before_answer  # nothing sent
    assert page.locator("#message textarea").input_value() == "What is this license about?"
    shot(page, "over-limit-choice")
    statuses = set()
    page.locator("#cut-middle").click()
    wait_until_finished(page, lambda: statuses.add(page.locator("#status").inner_text())
                        or answers(page).count() == before_questions + 1, "the answer on the cut document")
    assert any("Reading the prompt" in status for status in statuses), statuses
    assert questions(page).count() == before_questions + 1
    assert "from the middle" in questions(page).last.inner_text()
    assert not choice.is_visible()
    shot(page, "over-limit-cut")


def test_conversations_rename_switch_delete_and_export(page):
    page.locator("#title textarea").fill("License questions")
    page.locator("#rename").click()
    listing = page.locator("#conversations")
    wait_for(lambda: "License questions" in listing.inner_text(), what="the new name")
    page.locator("#export").click()
    exported = page.locator("#exported")
    wait_for(lambda: ".md" in exported.inner_text() and ".json" in exported.inner_text(), what="the exports")
    shot(page, "renamed-and-exported")
    listing.get_by_text("Write a long story", exact=False).click()  # the first conversation, named by its first question
    wait_for(lambda: "three colors" in questions(page).first.inner_text(), what="the first conversation")
    page.locator("#delete").click()
    wait_for(lambda: "Write a long story" not in listing.inner_text(), what="the deletion")
    assert "License questions" in listing.inner_text()
    shot(page, "deleted")


def test_dark_mode_and_the_models_tab(page):
    page.locator("#dark-mode").click()
    wait_for(lambda: "dark" in page.locator("body").get_attribute("class"), what="dark mode")
    shot(page, "dark-mode")
    page.get_by_role("tab", name="Models & hardware").click()
    wait_for(lambda: "embedded" in page.locator("#pairs").inner_text(), what="the pair table")
    wait_for(lambda: page.locator("#plan").inner_text().strip(), what="the plan")
    shot(page, "models-and-hardware")
    page.get_by_role("tab", name="Chat").click()
    page.locator("#dark-mode").click()


def test_a_kill_in_mid_answer_loses_no_earlier_message(embedded_dir, playwright_browser, tmp_path):
    data = tmp_path / "data"
    with specchat_process(data_dir=str(data)) as (url, process):
        page = open_page(playwright_browser, url)
        set_max_new_tokens(page, 24)
        send(page, "Say hello.")
        wait_until_finished(page, lambda: answers(page).count() == 1, "the first answer")
        first_answer = last_answer(page)
        set_max_new_tokens(page, 1024)
        send(page, "Write a long story about a dragon who loves books.")
        wait_for(lambda: answers(page).count() == 2 and len(last_answer(page)) > 80, what="the story to stream")
        time.sleep(2.5)  # past one periodic save of the answer in progress
        process.kill()  # SIGKILL: no clean-up runs
        process.wait()
        page.close()
    with running_specchat(data_dir=str(data)) as url:
        page = open_page(playwright_browser, url)
        wait_for(lambda: questions(page).count() == 2, what="the conversation to come back")
        assert "Say hello." in questions(page).first.inner_text()
        assert answers(page).first.inner_text().strip() == first_answer.strip()
        assert "dragon" in questions(page).last.inner_text()
        assert "interrupted" in last_answer(page)  # the answer so far, marked as cut short
        shot(page, "after-kill-and-restart")
        page.close()


def test_a_reopened_conversation_keeps_its_preset_and_system_prompt(page):
    """After a reload the page shows the conversation's own preset and system prompt, and its
    next question leaves them as they were saved (they used to fall back to Free chat's empty
    prompt, which the next question then wrote over the saved one)."""
    summarize = PRESETS["summarize"]
    page.locator("#new-conversation").click()
    wait_for(lambda: answers(page).count() == 0, what="an empty chat")
    set_max_new_tokens(page, 16)
    for preset in (PRESETS["free"], summarize):  # from whatever an earlier flow left chosen
        page.locator("#preset input").click()
        page.get_by_role("option", name=preset.label).click()
    wait_for(lambda: page.locator("#message textarea").input_value() == summarize.question, what="the preset's question")
    page.locator("#send").click()
    wait_until_finished(page, lambda: answers(page).count() == 1, "the first answer")

    def reopened_settings():
        page.reload()
        page.locator("#message textarea").wait_for(timeout=60_000)
        wait_for(lambda: answers(page).count() >= 1, what="the conversation to come back")
        open_accordion(page, "Settings")
        system = page.locator("#system textarea")
        wait_for(lambda: system.input_value() == summarize.system, timeout=30, what="its system prompt")
        shown = page.locator("#preset input").input_value(), system.input_value()
        open_accordion(page, "Settings")
        return shown

    assert reopened_settings() == (summarize.label, summarize.system)
    send(page, "And in one sentence?")
    wait_until_finished(page, lambda: answers(page).count() == 2, "the follow-up")
    assert reopened_settings() == (summarize.label, summarize.system)  # as saved, not replaced
    shot(page, "reopened-keeps-its-settings")
