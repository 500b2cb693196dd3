"""End to end in a real browser: `specchat --no-browser` serves the app; headless Chromium
(Debian's, driven by playwright; never `playwright install`) uses it as a person would. Every
flow leaves a screenshot in artifacts/ (git-ignored, kept by CI as test artifacts)."""

import os
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import DATA
from live_server import running_servers_log_tail, running_specchat, specchat_process
from pdf_fixture import write_pdf
from specchat.app.presets import PRESETS

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent.parent / "artifacts"
FINISHED = re.compile(r"done|cut off|stopped")
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
    # One read in the page: a count, then `.last`, races with the chat being cleared or redrawn.
    return page.evaluate("""() => {
        const bots = document.querySelectorAll('[data-testid="bot"]');
        return bots.length ? bots[bots.length - 1].innerText : "";
    }""")


def stats(page) -> str:
    return page.locator("#stats").inner_text()


def wait_until_finished(page, new_answer, what="the answer to finish", timeout=120):
    """Until `new_answer()` holds (the page shows the answer waited for, not an earlier one) and
    the figures line marks its end, unchanged for half a second."""
    def finished():
        text = stats(page)
        return new_answer() and FINISHED.search(text) and time.sleep(0.5) is None and stats(page) == text
    try:
        wait_for(finished, timeout=timeout, what=what)
    except pytest.fail.Exception:  # say what the page showed: slow, stuck, or ended unrecognized
        shown = answers(page)
        last = shown.last.inner_text()[-300:] if shown.count() else ""
        pytest.fail(f"timed out waiting for {what}: {shown.count()} answers shown, the last ending "
                    f"{last!r}; the figures line read {stats(page)!r}; the server printed last:\n"
                    f"{running_servers_log_tail()}")


def open_accordion(page, label):
    page.get_by_text(label, exact=True).click()


def paste_document(page, text):
    box = page.locator("#document textarea")
    if not box.is_visible():
        open_accordion(page, "Paste a document")
    fill_until_kept(box, text)


def new_conversation(page):
    """Start afresh and wait until the page has: its clear empties the paste box too, and a clear
    that lands after the next paste (the server can be seconds late just after a load) would send
    the question without its document."""
    box = page.locator("#document textarea")
    if not box.is_visible():
        open_accordion(page, "Paste a document")
    fill_until_kept(box, "(to be cleared)")
    page.locator("#new-conversation").click()
    wait_for(lambda: answers(page).count() == 0 and box.input_value() == "", what="an empty chat")


def fill_until_kept(box, text):
    # An accordion mounts its content as it opens and may reset a value typed too early:
    # type until the value sticks, as a person (slower than a script) always sees it.
    wait_for(lambda: box.fill(text) or time.sleep(0.5) or box.input_value() == text,
             timeout=15, what="the box to keep its text")


def set_max_new_tokens(page, count):
    number = page.locator("#max-new-tokens input[type=number]")
    if not number.is_visible():  # a test that failed may have left the accordion open
        open_accordion(page, "Settings")
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
    new_conversation(page)
    pdf = tmp_path / "launch-report.pdf"
    write_pdf(pdf, ["Launch report. The launch date moved to March 3.",
                    "Budget approved: 40,000 euros. Owner of the launch: Priya."])
    page.locator("#message input[type=file]").set_input_files(str(pdf))  # the 📎 at the message box
    wait_for(lambda: "launch-report.pdf" in page.locator("#attachment").inner_text(), what="the attachment")
    assert "tokens" in page.locator("#attachment").inner_text()
    choose_preset(page, PRESETS["summarize"])
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
    paste_document(page, too_long)
    wait_for(lambda: "over the limit" in page.locator("#meter").inner_text(), what="the meter to warn")
    send(page, "What is this license about?")
    choice = page.locator("#over-limit").first
    wait_for(choice.is_visible, what="the over-limit choice")
    assert re.search(r"Cut [\d,]+ tokens \(\d+% of the document\) from its middle", choice.inner_text())
    assert questions(page).count() == before_questions and last_answer(page) == before_answer  # nothing sent
    assert page.locator("#message textarea").input_value() == "What is this license about?"
    shot(page, "over-limit-choice")
    bubbles = set()
    page.locator("#cut-middle").click()
    wait_until_finished(page, lambda: bubbles.add(last_answer(page))
                        or answers(page).count() == before_questions + 1, "the answer on the cut document")
    assert any("Reading the prompt" in bubble and "tokens" in bubble for bubble in bubbles), bubbles
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
    search = page.locator("#search textarea, #search input").first
    search.fill("license QUESTIONS")
    wait_for(lambda: "Write a long story" not in listing.inner_text(), what="the search to filter the list")
    assert "License questions" in listing.inner_text()
    shot(page, "searched")
    search.fill("")
    wait_for(lambda: "Write a long story" in listing.inner_text(), what="the whole list again")
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


def test_an_idle_page_asks_for_a_few_frames_a_second_not_sixty(page, playwright_browser):
    """Gradio 6.31's status tracker leaves a 60 Hz animation loop running in every page, browser CPU
    spent on nothing (bench/notes/page-streaming.md); the page's first script slows loops that have
    run for a second to 4 frames a second. The Models tab polls (once a second) only while shown:
    the Chat tab's one timer (the model line, every 2 s) is all an idle chat asks of the server."""
    counting = playwright_browser.new_context(viewport={"width": 1200, "height": 1100})
    counting.add_init_script("""(() => { const frame = window.requestAnimationFrame.bind(window);
      window.framesAsked = 0; window.requestAnimationFrame = (callback) => (window.framesAsked++, frame(callback)); })();""")
    idle = counting.new_page()
    events = []
    idle.on("request", lambda request: events.append(time.monotonic()) if "/queue/join" in request.url else None)

    def events_in(seconds):  # Playwright's own wait: its events are delivered while it runs, not in a sleep
        started = time.monotonic()
        idle.wait_for_timeout(seconds * 1000)
        return sum(started <= moment for moment in events)

    try:
        idle.goto(page.url)
        idle.locator("#message textarea").wait_for(timeout=60_000)
        time.sleep(3)  # the page's first animations end
        before, started = idle.evaluate("window.framesAsked"), time.monotonic()
        chat_events = events_in(3)
        per_second = (idle.evaluate("window.framesAsked") - before) / (time.monotonic() - started)
        assert per_second < 15, f"{per_second:.0f} frames a second asked by an idle page"
        assert chat_events <= 2, f"{chat_events} events in 3 s from an idle chat"
        idle.get_by_role("tab", name="Models & hardware").click()
        idle.wait_for_timeout(500)
        assert events_in(3) >= 3, "the shown Models tab stopped polling"
        idle.get_by_role("tab", name="Chat").click()
        idle.wait_for_timeout(500)
        assert events_in(3) <= 2, "the Models tab polls after it was left"
    finally:
        counting.close()


def choose_preset(page, preset):
    """Open the list and click the preset until the box shows it. An update that lands while the
    list is open redraws it and detaches the option under the click (official CI waited 30 s on a
    detached option): the list is closed and opened again."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    box = page.locator("#preset input")

    def chosen():
        if box.input_value() != preset.label:
            box.click()
            try:
                page.get_by_role("option", name=preset.label).click(timeout=5_000)
            except PlaywrightTimeout:
                page.keyboard.press("Escape")
        return box.input_value() == preset.label
    wait_for(chosen, timeout=90, what=f"the preset {preset.label!r} to be chosen")


def test_a_kill_in_mid_answer_loses_no_earlier_message(embedded_dir, playwright_browser, tmp_path):
    """Killed mid-answer, then started again: every earlier message is back, the cut answer marked;
    the conversation keeps its preset and system prompt, and its next answer starts from the
    document's KV saved on disk instead of reading it again."""
    data = tmp_path / "data"
    summarize = PRESETS["summarize"]
    with specchat_process(data_dir=str(data)) as (url, process):
        page = open_page(playwright_browser, url)
        set_max_new_tokens(page, 24)
        choose_preset(page, summarize)
        paste_document(page, (DATA / "apache-2.0.txt").read_text())
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
        assert page.locator("#preset input").input_value() == summarize.label
        shot(page, "after-kill-and-restart")
        set_max_new_tokens(page, 16)
        send(page, "And in one sentence?")
        wait_until_finished(page, lambda: answers(page).count() == 3, "the answer after the restart")
        assert re.search(r"\(([\d,]+) prompt tokens reused\)", stats(page)), stats(page)  # from the disk
        page.close()


def test_first_launch_shows_the_model_loading_and_ctrl_c_stops_within_two_seconds(embedded_dir, playwright_browser):
    """A question sent while the model loads shows at once, its bubble saying so; the Chat tab
    names the model and says it is a demonstration model; Ctrl-C ends the server quickly with the
    tab still open (its event stream used to keep it up for 45 s)."""
    with specchat_process() as (url, process):
        page = open_page(playwright_browser, url)
        model_line = page.locator("#model-line")
        loading_at_send = "loading" in model_line.inner_text()
        send(page, "Say hello.")
        wait_for(lambda: questions(page).count() == 1, timeout=10, what="the question to show at once")
        if loading_at_send:  # the load may well be over by the time the page is up
            wait_for(lambda: "Loading the model" in last_answer(page) or "hello" in last_answer(page).lower(),
                     what="the loading bubble")
        wait_until_finished(page, lambda: answers(page).count() == 1, "the first answer")
        wait_for(lambda: "demonstration model" in model_line.inner_text(), what="the model line")
        assert "SmolLM2" in model_line.inner_text()
        shot(page, "first-launch")
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
        took = time.monotonic() - started
        page.close()
    assert took < 2.0 and process.returncode == 0, (took, process.returncode)


def test_what_was_typed_and_pasted_and_not_sent_survives_a_reload(playwright_browser, tmp_path):
    """Found: a reload, back and forward, or a server restart (after which Gradio reloads the page)
    emptied the message box and the document. Drafts are kept on disk for this browser; a send
    takes its draft away."""
    data, question = tmp_path / "data", "Who owns the launch? (typed with care)"

    def draft_on_disk() -> str:
        return "".join(path.read_text() for path in (data / "drafts").glob("*.json"))

    with running_specchat(data_dir=str(data)) as url:
        page = open_page(playwright_browser, url)
        paste_document(page, "Priya owns the launch, which moved to March 3.")
        box = page.locator("#message textarea")
        fill_until_kept(box, question)
        wait_for(lambda: question in draft_on_disk() and "Priya" in draft_on_disk(), timeout=60, what="the draft on disk")
        page.reload()
        box.wait_for(timeout=60_000)
        wait_for(lambda: box.input_value() == question, timeout=60, what="the typed question to come back")
        open_accordion(page, "Paste a document")
        assert "Priya owns the launch" in page.locator("#document textarea").input_value()
        set_max_new_tokens(page, 16)
        page.locator("#send").click()
        wait_until_finished(page, lambda: answers(page).count() == 1, "the answer")
        wait_for(lambda: question not in draft_on_disk(), timeout=30, what="the sent draft to go")
        shot(page, "draft-back-after-reload")
        page.close()


def test_a_reopened_conversation_keeps_its_preset_and_system_prompt(page):
    """After a reload the page shows the conversation's own preset and system prompt, and its
    next question leaves them as they were saved (they used to fall back to Free chat's empty
    prompt, which the next question then wrote over the saved one)."""
    summarize = PRESETS["summarize"]
    new_conversation(page)
    set_max_new_tokens(page, 16)
    for preset in (PRESETS["free"], summarize):  # from whatever an earlier flow left chosen
        choose_preset(page, preset)
    wait_for(lambda: page.locator("#message textarea").input_value() == summarize.question, what="the preset's question")
    page.locator("#send").click()
    wait_until_finished(page, lambda: answers(page).count() == 1, "the first answer")

    def reopened_settings():
        page.reload()
        page.locator("#message textarea").wait_for(timeout=60_000)
        wait_for(lambda: answers(page).count() >= 1, what="the conversation to come back")
        open_accordion(page, "Settings")
        system = page.locator("#system textarea")
        wait_for(lambda: system.input_value() == summarize.system, timeout=60, what="its system prompt")
        shown = (page.locator("#preset input").input_value(), system.input_value(),
                 page.locator("#max-new-tokens input[type=number]").input_value())
        open_accordion(page, "Settings")
        return shown

    assert reopened_settings() == (summarize.label, summarize.system, "16")  # the page's default is 512
    send(page, "And in one sentence?")
    wait_until_finished(page, lambda: answers(page).count() == 2, "the follow-up")
    assert "prompt tokens reused" in stats(page)  # the conversation as it was: its KV is reused
    assert reopened_settings() == (summarize.label, summarize.system, "16")  # as saved, not replaced
    shot(page, "reopened-keeps-its-settings")


def test_at_800_px_the_chat_keeps_the_width(page):
    page.set_viewport_size({"width": 800, "height": 900})
    try:
        wait_for(lambda: page.locator("#main-column").bounding_box()["width"] > 700, timeout=15,
                 what="the chat to take the whole width")
        assert page.locator("#message textarea").bounding_box()["width"] > 400  # it was 230 px
        shot(page, "800px-chat")
    finally:
        page.set_viewport_size({"width": 1200, "height": 1100})


# Each shown cell of the pairs table, headers too: its text, how far its words reach past the cell's
# right edge (which hides what is past it), and how its words break. A cell's own scrollWidth missed
# it: the words overflow the text inside the cell, which clips them.
PAIRS_CELLS_JS = """() => [...document.querySelectorAll('#pairs .body-cell, #pairs .header-cell')]
    .filter(cell => cell.getBoundingClientRect().width > 0)
    .map(cell => { const text = cell.querySelector('span.text') || cell, words = document.createRange();
        words.selectNodeContents(text);
        return [text.innerText, words.getBoundingClientRect().right - cell.getBoundingClientRect().right,
                getComputedStyle(text).wordBreak]; })"""


@pytest.mark.parametrize("width", [400, 800, 1280])
def test_the_models_table_shows_whole_words_and_scrolls_sideways_only_when_narrow(page, width):
    """Found at 400 px: the columns, squeezed to their share of the width, cut words ("embe", "Con").
    Below 800 px the table keeps its 800 px column widths and scrolls sideways; the page never does."""
    page.set_viewport_size({"width": width, "height": 900})
    try:
        page.get_by_role("tab", name="Models & hardware").click()
        wait_for(lambda: "embedded" in page.locator("#pairs").inner_text(), what="the pairs table")
        cells = page.evaluate(PAIRS_CELLS_JS)
        assert len(cells) >= 14
        assert all(past < 1 and breaks == "normal" for _, past, breaks in cells), cells
        table = page.locator("#pairs .virtual-table-viewport")
        assert table.evaluate("table => table.scrollWidth > table.clientWidth") == (width < 800)
        assert page.evaluate("() => document.documentElement.scrollWidth") <= width
        shot(page, f"{width}px-models")
    finally:
        page.get_by_role("tab", name="Chat").click()
        page.set_viewport_size({"width": 1200, "height": 1100})


@pytest.mark.parametrize("width, height", [(1280, 800), (1366, 680)])
def test_on_a_laptop_window_the_message_box_is_in_view_without_scrolling(page, width, height):
    """The chat takes what the window leaves (at a fixed 460 px the box started 742 px down and
    ended below an 800 px window)."""
    page.set_viewport_size({"width": width, "height": height})
    try:
        page.evaluate("() => window.scrollTo(0, 0)")
        wait_for(lambda: page.evaluate("() => window.scrollY") == 0, timeout=15, what="the top of the page")
        box = page.locator("#message").bounding_box()
        chat = page.locator("#chat").bounding_box()
        assert box["y"] + box["height"] <= height, (box, chat)
        assert chat["height"] >= 260
        shot(page, f"message-box-{width}x{height}")
    finally:
        page.set_viewport_size({"width": 1200, "height": 1100})


# In the page: when #stop is clicked, and when the page first shows the stop after it (a
# MutationObserver sees each change as it lands, before the next frame). Stopped: the last bubble
# no longer shows `started`, or, without it, the page says the answer stopped.
WATCH_THE_STOP = """started => {
    const text = selector => (document.querySelector(selector) || {}).innerText || "";
    const bots = () => document.querySelectorAll('[data-testid="bot"]');
    const last = () => { const all = bots(); return all.length ? all[all.length - 1].innerText : ""; };
    const stopped = () => started ? !last().includes(started)
        : text('#stats').includes('stopped') || text('#status').includes('Stopped') || bots().length === 0
          || last().includes('(stopped)');
    const watch = window.stopWatch = {clicked: null, stopped: null};
    document.querySelector('#stop').addEventListener('click', () => {
        watch.clicked = performance.now();
        const check = () => {
            if (watch.stopped === null && stopped()) {
                watch.stopped = performance.now();
                observer.disconnect();
            }
        };
        const observer = new MutationObserver(check);
        observer.observe(document.body, {subtree: true, childList: true, characterData: true});
        check();
    }, {capture: true, once: true});
}"""


def stop_and_time(page, started: str | None = None) -> tuple[float, float]:
    """Click Stop: (seconds from the click event to the page showing the stop, as the page timed
    them, the user's wait; seconds Playwright took to click, for a failure's message). Playwright's
    wait before it clicks and this test's polling are left out: under load on 2 cores they took
    up to seconds."""
    page.evaluate(WATCH_THE_STOP, started)
    clicked = time.monotonic()
    page.locator("#stop").click()
    dispatched = time.monotonic() - clicked
    watch = wait_for(lambda: page.evaluate("() => window.stopWatch.stopped !== null && window.stopWatch"),
                     timeout=30, what="the stop")
    return (watch["stopped"] - watch["clicked"]) / 1000, dispatched


def test_stop_during_a_long_read_takes_effect_within_a_second(page):
    new_conversation(page)
    paste_document(page, (DATA / "documents" / "lgpl-2.1.txt").read_text())
    send(page, "What does section 2 require?")
    wait_for(lambda: "Reading the prompt" in last_answer(page) and "left" in last_answer(page),
             what="the read's progress bar with the time left")
    shot(page, "reading-progress")
    took, dispatched = stop_and_time(page)
    # The bound: the engine stops between two layers (0.14-0.15 s here, also with two busy
    # loops beside it; 2.6 s when forwards cannot stop between layers).
    assert took < 1.0, f"Stop took {took:.2f} s in the page (Playwright took {dispatched:.2f} s to click)"
    shot(page, "stopped-during-read")


def test_a_19k_token_document_gets_every_choice_and_each_one_starts_and_stops(page):
    """Each choice offered for a document over twice the context starts what it says (a cut
    document read, or the first part summarized), shown in the answer's bubble, and Stop ends it
    within 2 s; nothing is sent before a choice. Summarizing in parts says how long it will take,
    from the pace of an answer timed before. (The full runs: `test_ui_chat.py`, tiny model.)"""
    new_conversation(page)
    set_max_new_tokens(page, 16)
    choose_preset(page, PRESETS["free"])
    send(page, "Say hello.")  # an answer timed here: the pace the estimate is made from
    wait_until_finished(page, lambda: answers(page).count() == 1, "the timed answer")
    new_conversation(page)
    huge = "\n\n".join((DATA / name).read_text() for name in ("gpl-3.0.txt", "documents/numpy-LICENSE.txt"))
    paste_document(page, huge)
    # Summarizing in parts goes first. Stop is timed by the page: timed from here it seemed to
    # creep up over this loop's big pastes (to 2.1 s), though the engine side stayed under 0.05 s.
    choices = {"in-parts": "Summarizing part 1 of 3", "cut-start": "Reading the prompt",
               "cut-middle": "Reading the prompt", "cut-end": "Reading the prompt"}
    for button, started in choices.items():
        send(page, "What is this about?")
        choice = page.locator(f"#{button}")
        wait_for(choice.is_visible, what=f"the choice {button}")
        assert not page.locator("#shorter-answer").is_visible()  # no answer fits beside this prompt
        if button == "cut-start":
            assert re.search(r"Cut [\d,]+ tokens \((5\d|6\d)% of the document\) from its start", choice.inner_text())
            assert re.search(r"read as 3 parts, about [\d.]+ (s|min|h) on this machine before the answer",
                             " ".join(page.locator("#over-limit").all_inner_texts()))
            shot(page, "19k-choices")
        choice.click()
        wait_for(lambda: started in last_answer(page), what=f"{button} to start")
        if button == "in-parts":
            assert re.search(r"about [\d.]+ (s|min|h) left for the parts", last_answer(page))
            shot(page, "19k-in-parts-estimate")
        took, dispatched = stop_and_time(page, started)
        assert took < 2.0, f"{button}: Stop took {took:.2f} s in the page (Playwright took {dispatched:.2f} s to click)"
        new_conversation(page)
        paste_document(page, huge)


def test_the_main_job_a_long_document_summarized_then_a_follow_up(page):
    """The issue's first finding: a ~7.7K-token licence with the Summarize preset. The default
    answer limit does not fit beside it, so the page offers the answer that does, which ends
    within the context; the follow-up then makes room by leaving the first turn out (the
    document stays) and starts from the document's KV instead of reading it again."""
    new_conversation(page)
    set_max_new_tokens(page, 512)
    choose_preset(page, PRESETS["summarize"])
    document = (DATA / "gpl-3.0.txt").read_text()
    paste_document(page, document)
    meter, box = page.locator("#meter"), page.locator("#document textarea")
    try:
        wait_for(lambda: "over the limit" in meter.inner_text(), timeout=40, what="the meter to count the document")
    except pytest.fail.Exception:
        # Twice in official-like CI, right after the 19k test, the meter went on counting no
        # document for 120 s; the box still held it (isolated, the three tests pass). What is sent
        # is read from the box, so only the count was stale: change the box as a person would.
        assert box.input_value() == document, f"the pasted document was lost: the box holds {len(box.input_value())} characters"
        fill_until_kept(box, document + "\n")
        wait_for(lambda: "over the limit" in meter.inner_text(), what="the meter to count the document, pasted again")
    page.locator("#send").click()
    shorter = page.locator("#shorter-answer")
    wait_for(shorter.is_visible, what="the offer of an answer that fits")
    shot(page, "main-job-choices")
    shorter.click()
    # A 7.7K-token read and a ~480-token answer beside Chromium on 2 cores: on a slowed machine
    # one CI run waited past 120 s for it. This test is about the flow; speed is the bench's.
    wait_until_finished(page, lambda: answers(page).count() == 1, "the summary", timeout=300)
    summary = last_answer(page)
    assert summary.strip() and "context is full" not in summary and "context is full" not in stats(page)
    shot(page, "main-job-summary")
    send(page, "Who can use it?")  # it does not fit beside the first turn: that turn is left out unasked
    # One CI run waited past 300 s here after a 100 s summary; the failure now says what the page showed.
    wait_until_finished(page, lambda: answers(page).count() == 2, "the follow-up's answer", timeout=600)
    assert last_answer(page).strip() and "reused" in stats(page)
    assert "left out" in questions(page).first.inner_text() and not page.locator("#over-limit").is_visible()
    shot(page, "main-job-follow-up")


def prompt_and_context(page) -> tuple[int, int]:
    """The prompt's tokens and the context's, as the meter reads them."""
    meter = page.locator("#meter")
    counted = wait_for(lambda: re.search(r"([\d,]+) \+ [\d,]+ / ([\d,]+) tokens", meter.inner_text()),
                       what="the meter's count")
    return int(counted.group(1).replace(",", "")), int(counted.group(2).replace(",", ""))


def test_a_follow_up_on_a_long_document_leaves_the_oldest_turn_out_without_a_click(page):
    """A 5.9K-token licence, a first question and answer, then a follow-up whose answer limit fits
    the context only without that first turn: it is answered at once, the first turn marked as
    left out (the document stays), no choice offered; Escape then stops the answer."""
    new_conversation(page)
    choose_preset(page, PRESETS["free"])
    set_max_new_tokens(page, 16)
    paste_document(page, (DATA / "documents" / "lgpl-2.1.txt").read_text())
    # A first question of some length: leaving it out frees room for the follow-up's longer limit.
    send(page, "What is this licence called, and who published it? Please answer in one short sentence that "
               "names the licence, its version and the organisation behind it.")
    wait_until_finished(page, lambda: answers(page).count() == 1, "the first answer", timeout=400)
    page.locator("#message textarea").fill("Who can use it?")
    time.sleep(2)  # the meter recounts with the question in the box
    prompt, context = prompt_and_context(page)
    limit = -(-(context - prompt + 1) // 16) * 16  # just over beside the first turn
    set_max_new_tokens(page, limit)
    wait_for(lambda: "over the limit" in page.locator("#meter").inner_text(), what="the meter to warn")
    page.locator("#send").click()
    wait_for(lambda: answers(page).count() == 2 and last_answer(page).strip()
             and "⏳" not in last_answer(page), what="the follow-up's answer to start", timeout=300)
    assert not page.locator("#over-limit").is_visible()  # nothing to click
    assert "oldest turn was left out" in page.locator("#status").inner_text()
    first_question, follow_up = questions(page).first.inner_text(), questions(page).last.inner_text()
    assert "left out of what the model reads" in first_question and "left out" in answers(page).first.inner_text()
    assert "left out" not in follow_up
    shot(page, "follow-up-without-a-click")
    page.keyboard.press("Escape")  # stops the answer, as Stop does
    wait_until_finished(page, lambda: "(stopped)" in last_answer(page), "Escape to stop the answer")
    shot(page, "follow-up-stopped-with-escape")


def test_no_choice_is_offered_that_cannot_make_room(page):
    """Leaving the earlier turn out cannot make room for a document over the whole context: only
    the choices that can are offered (a cut does)."""
    new_conversation(page)
    set_max_new_tokens(page, 16)
    send(page, "Hello")
    wait_until_finished(page, lambda: answers(page).count() == 1, "the first answer")
    too_long = (DATA / "gpl-3.0.txt").read_text() + (DATA / "apache-2.0.txt").read_text()[:4000]  # ~8.6K tokens
    paste_document(page, too_long)
    send(page, "What is this license about?")
    wait_for(page.locator("#cut-middle").is_visible, what="the over-limit choices")
    assert not page.locator("#leave-out").is_visible()
    assert answers(page).count() == 1  # nothing sent, nothing left out
    assert "left out" not in questions(page).first.inner_text()
    shot(page, "no-choice-that-cannot-make-room")


def test_an_attachment_stays_with_its_conversation(page, tmp_path):
    """A file attached and a question typed in one conversation stay there: another conversation
    opens without them, and they come back with their own; New starts with the preset's question."""
    new_conversation(page)
    choose_preset(page, PRESETS["free"])
    set_max_new_tokens(page, 16)
    send(page, "Name three colors.")
    wait_until_finished(page, lambda: answers(page).count() == 1, "the first conversation's answer")
    page.locator("#new-conversation").click()
    wait_for(lambda: answers(page).count() == 0, what="an empty chat")
    send(page, "Name three animals.")
    wait_until_finished(page, lambda: answers(page).count() == 1 and "animals" in questions(page).last.inner_text(),
                        "the second conversation's answer")
    notes = tmp_path / "meeting-notes.txt"
    notes.write_text("The launch moved to March 3. Priya owns it.")
    page.locator("#message input[type=file]").set_input_files(str(notes))
    attachment, box = page.locator("#attachment"), page.locator("#message textarea")
    wait_for(lambda: "meeting-notes.txt" in attachment.inner_text(), what="the attachment")
    fill_until_kept(box, "When is the launch?")
    listing = page.locator("#conversations")
    listing.get_by_text("Name three colors", exact=False).click()
    wait_for(lambda: "colors" in questions(page).first.inner_text(), what="the first conversation")
    wait_for(lambda: attachment.inner_text().strip() == "" and box.input_value() == "",
             what="the other conversation's attachment and question to stay there")
    shot(page, "attachment-stays-behind")
    listing.get_by_text("Name three animals", exact=False).click()
    wait_for(lambda: "meeting-notes.txt" in attachment.inner_text() and box.input_value() == "When is the launch?",
             what="the attachment and question to come back with their conversation")
    shot(page, "attachment-comes-back")
    choose_preset(page, PRESETS["summarize"])
    page.locator("#new-conversation").click()
    wait_for(lambda: answers(page).count() == 0 and box.input_value() == PRESETS["summarize"].question
             and attachment.inner_text().strip() == "", what="a new conversation with the preset's question")
    shot(page, "new-conversation-keeps-the-preset-question")


def test_a_choice_that_fails_says_why_in_the_page(page):
    """A choice that no longer makes room when clicked (the question grew after it was offered)
    says why in the status line, not in a bare "Error", and its stale panel goes."""
    new_conversation(page)
    choose_preset(page, PRESETS["free"])
    set_max_new_tokens(page, 512)
    paste_document(page, (DATA / "gpl-3.0.txt").read_text())  # ~7.7K tokens: a shorter answer fits beside it
    send(page, "What is this?")
    shorter = page.locator("#shorter-answer")
    wait_for(shorter.is_visible, what="the offer of an answer that fits")
    fill_until_kept(page.locator("#message textarea"), "What is this? " + (DATA / "apache-2.0.txt").read_text()[:3000])
    shorter.click()
    status = page.locator("#status")
    wait_for(lambda: "no useful answer fits" in status.inner_text(), what="the reason in the page")
    assert not page.locator("#over-limit").is_visible() and answers(page).count() == 0  # nothing sent
    shot(page, "choice-error-reason")


def shown_text(page) -> str:
    """The last answer's words, without its ending mark ("(cut off at the answer limit…)")."""
    return " ".join(re.split(r"\((?:cut off|stopped)", last_answer(page))[0].split())


def test_continue_extends_a_cut_answer_and_retry_keeps_versions_to_page_through(page):
    """Continue carries an answer cut at the answer limit on in the same bubble, marked in the
    figures, and Stop (Escape) stops it; Retry writes a second version, and ‹ › page between them,
    each with its own figures, the one shown kept through a reload."""
    new_conversation(page)
    choose_preset(page, PRESETS["free"])
    set_max_new_tokens(page, 16)
    send(page, "Write a long story about a lighthouse keeper.")
    wait_until_finished(page, lambda: answers(page).count() == 1, "the first answer")
    assert "16 tokens, cut off at the answer limit" in stats(page)
    go_on, label = page.locator("#continue"), page.locator("#version-label")
    wait_for(go_on.is_visible, what="the Continue button")
    cut = shown_text(page)
    shot(page, "continue-offered")
    go_on.click()
    wait_until_finished(page, lambda: "continued once" in stats(page), "the continued answer")
    continued = shown_text(page)
    assert answers(page).count() == 1 and "32 tokens, cut off" in stats(page)
    assert continued.startswith(cut[:-10]) and len(continued) > len(cut)  # the same answer, longer
    shot(page, "continued")

    page.get_by_label("Retry").last.click()
    wait_until_finished(page, lambda: label.is_visible() and "2/2" in label.inner_text(), "the second version")
    second = shown_text(page)
    assert answers(page).count() == 1 and questions(page).count() == 1 and "continued" not in stats(page)
    shot(page, "retry-second-version")
    page.locator("#older-version").click()
    wait_for(lambda: "1/2" in label.inner_text() and shown_text(page) == continued, what="the first version back")
    assert "continued once" in stats(page)  # the version's own figures
    shot(page, "retry-first-version")
    page.reload()
    page.locator("#message textarea").wait_for(timeout=60_000)
    wait_for(lambda: label.is_visible() and "1/2" in label.inner_text() and shown_text(page) == continued,
             what="the version shown to stay through a reload")
    page.locator("#newer-version").click()
    wait_for(lambda: "2/2" in label.inner_text() and shown_text(page) == second, what="the second version again")

    set_max_new_tokens(page, 512)
    go_on.click()
    wait_for(lambda: len(shown_text(page)) > len(second) + 20, what="the continuation to stream in")
    page.keyboard.press("Escape")
    wait_until_finished(page, lambda: "stopped" in stats(page), "Escape to stop the continuation")
    assert shown_text(page).startswith(second[:-10]) and "continued once" in stats(page)
    assert go_on.is_visible() and "2/2" in label.inner_text()  # a stopped answer can go on again
    shot(page, "continue-stopped")
