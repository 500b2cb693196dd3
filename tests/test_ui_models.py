"""The Models & hardware tab: its renderers, the background download (real downloads through the
real huggingface_hub from the loopback stand-in hub), switching pairs, and the tab in Chromium."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
from conftest import DATA
from hub_pairs import TARGET_REPO
from live_server import free_port
from standin_hub import hub_online
from test_browser import ARTIFACTS, CHROMIUM, browser_or_skip, wait_for

from specchat.app.engine_handle import EngineHandle
from specchat.app.plan_cmd import memory_rows, plan_lines, plan_markdown, profile_lines, profile_markdown
from specchat.app.pair_download import PairDownload, download_markdown
from specchat.app.ui_models import (PROFILE_WAIT_SECONDS, ModelsPanel, ProfileHolder, build_models_tab,
                                    engine_plan_markdown)
from specchat.core import embedded, model_cache, selftest
from specchat.core.files import human_size
from specchat.core.hardware import HardwareProfile
from specchat.core.loading import load_engine
from specchat.core.planning import make_plan
from specchat.core.registry import load_registry
from specchat.core.speculative import verify

TARGET_WEIGHTS = f"{TARGET_REPO}/model.safetensors"
PROFILES = DATA / "profiles"


@pytest.fixture
def caches(tmp_path, monkeypatch, embedded_dir):
    """A private Hub cache and specchat cache (as in test_download.py), sharing this machine's
    converted embedded model and hardware profile so that loading converts and measures nothing."""
    from huggingface_hub import constants

    shared = embedded.cache_root()
    (shared / "hardware").mkdir(parents=True, exist_ok=True)
    private = tmp_path / "specchat"
    private.mkdir()
    for name in ("embedded", "hardware"):
        (private / name).symlink_to(shared / name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(private))
    return tmp_path


@pytest.fixture
def models_file(tiny_pair, tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(tiny_pair.models_toml())
    return path


def synthetic(name: str) -> ProfileHolder:
    profile = HardwareProfile.load(PROFILES / f"{name}.json")
    return ProfileHolder(read=lambda refresh: profile)


def panel_for(models_file, model: str, loader=None, profiles: ProfileHolder | None = None,
              endpoint: str | None = None) -> ModelsPanel:
    registry = load_registry(models_file)
    load = loader or (lambda pair_id, progress: load_engine(pair_id, progress=progress, registry=registry))
    return ModelsPanel(EngineHandle(load, model), registry, PairDownload(endpoint), profiles or synthetic("rtx4090-24gb"))


def wait_until_ended(downloads: PairDownload, timeout: float = 60):
    return wait_for(lambda: downloads.snapshot().state not in ("running", "cancelling") and downloads.snapshot(),
                    timeout=timeout, what="the download to end")


def row_of(panel: ModelsPanel, pair_id: str, technical: bool = False) -> list[str]:
    return next(row for row in panel.pair_table(technical) if row[0] == pair_id)


# ---- renderers ------------------------------------------------------------------------------


def test_the_tab_gives_each_model_s_measured_speed_in_words_and_the_cli_its_curves():
    from specchat.core.hardware import FORWARD_KERNELS, ModelCurves
    from specchat.core.speculative.forward_times import ForwardTimes

    def times(context, ms, ratio16):
        return ForwardTimes((1, 2, 17), (1.0, 1.1, ratio16), ms / 1e3, context, "cpu")

    current = ModelCurves(f"HuggingFaceTB/SmolLM2-135M-Instruct@local:float32#k{FORWARD_KERNELS}",
                          (times(256, 70.3, 2.13), times(8175, 91.9, 2.79)))
    stale = ModelCurves(f"HuggingFaceTB/SmolLM2-135M-Instruct@local:float32#k{FORWARD_KERNELS - 1}",
                        (times(256, 300.0, 9.0),))
    profile = HardwareProfile.load(PROFILES / "cpu-only-32gb.json").with_curves(current).with_curves(stale)
    text = profile_markdown(profile)
    assert ("- **speed** SmolLM2-135M-Instruct (float32): 70-92 ms per token at 256-8,175 tokens of context; "
            "checking 16 drafted tokens at once takes as long as 2.1-2.8 one-token steps") in text
    assert "300" not in text and "t(2)" not in text  # the stale curve left out; no curves in the tab
    lines = "\n".join(profile_lines(profile))
    assert "t(17)=2.79" in lines and f"#k{FORWARD_KERNELS - 1}" in lines  # the CLI prints every curve


def test_profile_and_plan_markdown_say_what_the_cli_says():
    profile = HardwareProfile.load(PROFILES / "2x-rtx4090.json")
    text = profile_markdown(profile)
    assert "- **GPU 1** NVIDIA GeForce RTX 4090" in text and "host->GPU" in text
    assert f"*measured {profile.measured_on}, machine key {profile.machine_key()}*" in text
    plan = make_plan(profile, load_registry().get("qwen3-8b"), 32768)
    markdown, lines = plan_markdown(plan), plan_lines(plan)
    assert markdown.startswith(f"**{lines[0]}**")
    rows = markdown.splitlines()
    for choice in plan.reasons:  # every choice with its reason, one table row each
        escaped = choice.replace("_", "\\_")
        assert sum(row.startswith(f"| {escaped} | ") for row in rows) == 1
    assert "| **total on cuda:0** | cuda:0 |" in markdown and "headroom" in markdown
    headers = 2
    assert sum(row.startswith("| ") for row in rows) == headers + len(plan.reasons) + len(memory_rows(plan))


def test_a_model_without_a_plan_says_what_runs(tiny_model_dir):
    engine = load_engine(str(tiny_model_dir), progress=lambda line: None)
    assert engine.plan is None
    assert engine_plan_markdown(engine) == (f"`{engine.name}` runs without a plan: chain decoding when the mode is "
                                            "auto, float32 weights on cpu.")


def test_the_profile_is_read_once_and_measured_again_on_request():
    profile = HardwareProfile.load(PROFILES / "cpu-only-32gb.json")
    reads = []
    holder = ProfileHolder(read=lambda refresh: reads.append(refresh) or profile)
    assert holder.get(timeout=10) is profile
    assert "- **GPU** none: models run on the CPU" in holder.markdown()
    for _ in range(3):
        holder.markdown()
    assert reads == [False]
    assert holder.measure_again() == ""
    wait_for(lambda: reads == [False, True] and "Measuring again" not in holder.markdown(), timeout=10,
             what="the second measurement")


class EngineThreadHandle:
    """A stand-in for `EngineHandle` with the engine loaded: `call(fn)` runs `fn(engine)` (on the
    engine thread, in the app); `get` would hand the engine out beside an answer, so it fails."""

    def __init__(self, engine, status: str = "ready"):
        self.engine, self.model, self._status, self.calls = engine, "stub", status, 0

    def status(self) -> str:
        return self._status

    def call(self, fn):
        self.calls += 1
        return fn(self.engine)

    def get(self, timeout=None):
        raise AssertionError("the self-test must run through handle.call, never beside an answer")


def test_the_self_test_button_runs_on_the_engine_thread_and_shows_the_report(monkeypatch):
    monkeypatch.setattr(selftest, "engine_modes", lambda engine: [])  # the rules only: no model needed
    handle = EngineThreadHandle(SimpleNamespace(name="stub"))
    panel = ModelsPanel(handle, load_registry(), profiles=synthetic("cpu-only-32gb"))
    report = panel.self_test()
    assert handle.calls == 1
    rows = [row for row in report.splitlines() if row.startswith("| ")]
    assert report.startswith("**Self-test of `stub`**") and len(rows) == 1 + 5  # the header, 5 checks
    assert sum("✅ PASS" in row for row in rows) == 3 and "**all checks hold" in report
    assert "max \\|emitted - P\\|" in report  # a detail's | does not split its table cell

    monkeypatch.setattr(verify, "residual", lambda p, q: p)  # TriForce's bug
    report = panel.self_test()
    assert "❌ FAIL" in report and "FAILED" in report
    assert ModelsPanel(EngineThreadHandle(None, "loading"), load_registry(),
                       profiles=synthetic("cpu-only-32gb")).self_test().startswith("The self-test runs on the loaded")


# ---- downloads through the stand-in hub -----------------------------------------------------


def test_a_download_shows_its_progress_and_flips_the_pair_to_downloaded(hub, caches, models_file, tiny_model_dir,
                                                                        tiny_pair):
    panel = panel_for(models_file, str(tiny_model_dir), endpoint=hub.endpoint)
    pair = panel.registry.get("tiny")
    assert row_of(panel, "tiny")[-1] == "no" and "Nothing" not in panel.poll()["download"]
    size = len(tiny_pair.target.files["model.safetensors"])
    hub.throttle(TARGET_WEIGHTS, size / 2)
    with hub_online():
        assert panel.download("tiny") == ""
        assert "is downloading" in panel.download("tiny")  # one at a time
        hub.wait_for_bytes(TARGET_WEIGHTS, size // 4)
        live = wait_for(lambda: "model.safetensors" in panel.poll()["download"] and panel.poll()["download"],
                        timeout=10, what="live progress")
        assert "of" in live and "%)" in live and "/s" in live
        assert "still downloading" in panel.use("tiny")
        hub.throttle(TARGET_WEIGHTS, None)
        ended = wait_until_ended(panel.downloads)
    assert ended.state == "downloaded", ended.error
    assert ended.progress.done_bytes == ended.progress.total_bytes == pair.download_bytes  # 100%
    assert download_markdown(ended).startswith(f"**tiny** downloaded: {human_size(pair.download_bytes)}")
    assert panel.poll()["downloads_ended"] == 1 and row_of(panel, "tiny")[-1] == "yes"


def test_a_cancelled_download_keeps_its_part_and_resumes(hub, caches, models_file, tiny_model_dir, tiny_pair):
    panel = panel_for(models_file, str(tiny_model_dir), endpoint=hub.endpoint)
    size = len(tiny_pair.target.files["model.safetensors"])
    hub.stall(TARGET_WEIGHTS, size // 3)  # no progress is reported while stalled: cancelling shows
    assert panel.downloads.cancel() == "No download is running."
    with hub_online():
        panel.download("tiny")
        hub.wait_for_bytes(TARGET_WEIGHTS, size // 3)
        assert panel.downloads.cancel() == ""
        assert panel.poll()["download"].endswith(" — cancelling…")
        hub.unstall(TARGET_WEIGHTS)
        ended = wait_until_ended(panel.downloads, timeout=30)
        assert ended.state == "cancelled"
        assert "download cancelled at" in download_markdown(ended) and "resume" in download_markdown(ended)
        parts = list(model_cache.hub_cache().rglob("*.specchat-part"))
        kept = parts[0].stat().st_size if len(parts) == 1 else 0
        assert 0 < kept < size
        assert row_of(panel, "tiny")[-1].startswith("partly")
        panel.download("tiny")
        assert wait_until_ended(panel.downloads).state == "downloaded"
    ranges = [request.range for request in hub.gets(TARGET_WEIGHTS)]
    assert ranges == [None, f"bytes={kept}-"]  # resumed from the kept part


def test_cancel_ends_a_stalled_download_at_once_not_after_its_retries(hub, caches, models_file, tiny_model_dir,
                                                                      tiny_pair, monkeypatch):
    """With no byte arriving, the progress callback never ran: Cancel waited out every try (83 s
    at the defaults) and the download then ended as "failed after 6 tries"."""
    import time

    from huggingface_hub import constants

    from specchat.core import hub_requests

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)  # each stalled try times out in 1 s
    monkeypatch.setattr(hub_requests, "RETRY_PAUSES", (30.0,) * 5)  # a pause a cancel must cut short
    panel = panel_for(models_file, str(tiny_model_dir), endpoint=hub.endpoint)
    size = len(tiny_pair.target.files["model.safetensors"])
    hub.stall(TARGET_WEIGHTS, size // 3)
    with hub_online():
        panel.download("tiny")
        hub.wait_for_bytes(TARGET_WEIGHTS, size // 3)
        time.sleep(1.5)  # the first try timed out: the download pauses before the next
        cancelled = time.monotonic()
        assert panel.downloads.cancel() == ""
        ended = wait_until_ended(panel.downloads, timeout=30)
        assert ended.state == "cancelled" and time.monotonic() - cancelled < 5
        hub.unstall(TARGET_WEIGHTS)


def test_cancel_while_the_hub_is_unreachable_ends_cancelled_at_once_and_clears_the_refusals(
        hub, caches, models_file, tiny_model_dir):
    """With the Hub unreachable, Cancel stayed "cancelling…" through huggingface_hub's retries of
    the listing (about 23 s), then the download ended "failed: cannot reach the Hub"; meanwhile
    "Use this pair" said "still downloading", and that stayed on the page after the download ended."""
    import time

    panel = panel_for(models_file, str(tiny_model_dir), endpoint=hub.endpoint)
    hub.close()
    with hub_online():
        assert panel.download("tiny") == ""
        busy, still = panel.download("tiny"), panel.use("tiny")
        assert "is downloading" in busy and "still downloading" in still
        assert [panel.poll(message)["message"] for message in (busy, still)] == [busy, still]  # still true
        time.sleep(1.5)  # the listing's first try failed: it waits before the next
        cancelled = time.monotonic()
        assert panel.downloads.cancel() == ""
        ended = wait_until_ended(panel.downloads, timeout=40)
        took = time.monotonic() - cancelled
    assert ended.state == "cancelled" and took < 2, (ended.state, ended.error, took)
    assert download_markdown(ended) == ("**tiny**: download cancelled before it fetched any file; press Download "
                                        "to start it again.")
    assert [panel.poll(message)["message"] for message in (busy, still)] == ["", ""]  # not left on the page
    assert panel.poll("Pick a pair first.")["message"] == "Pick a pair first."  # other messages stay
    assert panel.use("tiny").startswith("**tiny** is not downloaded")


def test_a_broken_download_reports_its_error(hub, caches, models_file, tiny_model_dir):
    panel = panel_for(models_file, str(tiny_model_dir), endpoint=hub.endpoint)
    hub.corrupt(TARGET_WEIGHTS)
    with hub_online():
        panel.download("tiny")
        ended = wait_until_ended(panel.downloads)
    assert ended.state == "failed" and "integrity check" in ended.error
    assert download_markdown(ended) == f"⚠️ **tiny**: {ended.error}"
    assert panel.downloads.ended == 1 and row_of(panel, "tiny")[-1].startswith("partly")  # the good files stay


def test_offline_the_download_says_what_is_missing(caches, models_file, tiny_model_dir):
    panel = panel_for(models_file, str(tiny_model_dir))  # tests run with HF_HUB_OFFLINE=1
    panel.download("tiny")
    ended = wait_until_ended(panel.downloads)
    assert ended.state == "failed" and "not downloaded" in ended.error and "while online" in ended.error


# ---- switching pairs ------------------------------------------------------------------------


def test_a_pair_that_does_not_fit_or_is_not_downloaded_is_not_loaded(caches, models_file, tiny_model_dir,
                                                                      monkeypatch):
    monkeypatch.setenv("SPECCHAT_PRECISION", "exact")  # the bf16 KV; the 8-bit one fits this laptop's RAM
    loads = []
    panel = panel_for(models_file, "embedded", loader=lambda model, progress: loads.append(model),
                      profiles=synthetic("laptop-rtx4060-8gb"))
    wait_for(lambda: loads == ["embedded"], timeout=10, what="the first load")
    refusal = panel.use("llama3.1-8b")
    assert refusal.startswith("⚠️ llama3.1-8b at 131,072 tokens does not fit") and "nearest that fits" in refusal
    pair = panel.registry.get("tiny")
    assert panel.use("tiny") == f"**tiny** is not downloaded: download it first ({human_size(pair.download_bytes)})."
    assert panel.use("embedded") == "**embedded** is already loaded."
    assert panel.use(None) == "Pick a pair first." and panel.download("embedded").endswith("nothing to download.")
    assert loads == ["embedded"] and panel.handle.model == "embedded"


def test_use_this_pair_answers_while_the_first_profile_is_still_measured(caches, models_file):
    # Found: the button waited for the first measurement of this machine, seconds on a first launch.
    measured = threading.Event()
    profiles = ProfileHolder(read=lambda refresh: measured.wait(60) and None)
    panel = panel_for(models_file, "embedded", loader=lambda model, progress: None, profiles=profiles)
    answers: list[str] = []
    clicked = threading.Thread(target=lambda: answers.append(panel.use("tiny")), daemon=True)
    clicked.start()
    clicked.join(timeout=PROFILE_WAIT_SECONDS + 20)
    measured.set()
    assert answers and answers[0].startswith("**tiny** is not downloaded")


@pytest.mark.parametrize("profile_name", ["laptop-rtx4060-8gb", "cpu-only-32gb"])
def test_the_table_says_what_use_this_pair_does(caches, models_file, profile_name):
    """One answer to "does it fit": the table's verdict is the plan "Use this pair" checks (on the
    same profile), so a pair the table calls too big is refused, and one it says fits is not."""
    loads = []
    panel = panel_for(models_file, "embedded", loader=lambda model, progress: loads.append(model),
                      profiles=synthetic(profile_name))
    for pair_id in ("llama3.1-8b", "qwen2.5-7b", "qwen3-8b"):
        row, plain = row_of(panel, pair_id, technical=True), row_of(panel, pair_id)[5]
        refusal = panel.use(pair_id)
        if row[4].startswith("fits"):
            assert refusal.endswith("is not downloaded: download it first (" +
                                    f"{human_size(panel.registry.get(pair_id).download_bytes)}).")
            assert plain.startswith("Runs on ") and "KV" not in plain
        else:
            assert row[4].startswith("does not fit") and refusal == f"⚠️ {row[5]}"
            assert plain.startswith("Too big for this computer")
    embedded_plain = row_of(panel, "embedded")[5]  # says what it is for, as the chat's model line does
    assert embedded_plain.startswith("A small offline demonstration model") and "Runs on " in embedded_plain
    verdicts = {pair_id: row_of(panel, pair_id)[4] for pair_id in ("embedded", "qwen2.5-7b")}
    if profile_name == "cpu-only-32gb":  # fits, with the notes the plan gives
        assert verdicts == {"embedded": "fits (CPU only)", "qwen2.5-7b": "fits (CPU only, slow)"}
    else:
        assert verdicts == {"embedded": "fits",
                            "qwen2.5-7b": "fits (4-bit, KV in 8 bits offloaded to RAM)"}


def test_use_this_pair_loads_a_downloaded_pair_and_shows_its_plan(hub, caches, models_file, tiny_model_dir):
    panel = panel_for(models_file, str(tiny_model_dir), endpoint=hub.endpoint)
    wait_for(lambda: panel.handle.status() == "ready", timeout=60, what="the local model")
    assert panel.poll()["status"] == f"Loaded: `{tiny_model_dir}`" and "without a plan" in panel.poll()["plan"]
    with hub_online():
        panel.download("tiny")
        assert wait_until_ended(panel.downloads).state == "downloaded"
    assert panel.use("tiny") == ""
    # The loader's own progress line follows once its thread has reported one (a race).
    assert panel.poll()["status"].startswith("Loading **tiny** (Tiny test pair)…")
    wait_for(lambda: panel.handle.status() != "loading", timeout=60, what="the pair to load")
    view = panel.poll()
    assert view["status"] == "Loaded: **tiny** (Tiny test pair)", view["status"]
    assert view["plan"].startswith("**tiny at 256 tokens: ") and "| Choice | Why |" in view["plan"]


# ---- in Chromium ------------------------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.slow
def test_the_tab_downloads_a_pair_in_the_browser(hub, caches, models_file, embedded_dir):
    sync_playwright = browser_or_skip()
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    registry = load_registry(models_file)
    handle = EngineHandle(lambda model, progress: load_engine(model, progress=progress, registry=registry), "embedded")
    with gr.Blocks() as demo, gr.Tab("Models & hardware"):
        build_models_tab(handle, str(models_file), PairDownload(hub.endpoint))
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    with hub_online(), sync_playwright() as playwright:
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, ssr_mode=False, quiet=True)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/")
            page.locator("#pairs").get_by_text("Tiny test pair").wait_for(timeout=30_000)
            page.locator("#pair-picker input").click()
            page.get_by_role("option", name="tiny: Tiny test pair").click()
            hub.stall(TARGET_WEIGHTS, 1)  # until "Use this pair" was refused
            page.locator("#download").click()
            wait_for(lambda: "tiny:" in page.locator("#download-progress").inner_text(), timeout=10,
                     what="the download to start")
            page.locator("#use-pair").click()
            wait_for(lambda: "still downloading" in page.locator("#pair-message").inner_text(), timeout=30,
                     what="the refusal while it downloads")
            hub.unstall(TARGET_WEIGHTS)
            wait_for(lambda: "downloaded" in page.locator("#download-progress").inner_text(), timeout=30,
                     what="the download to end")
            assert "tiny downloaded" in page.locator("#download-progress").inner_text()
            wait_for(lambda: not page.locator("#pair-message").inner_text().strip(), timeout=5,
                     what="the refusal to go once the download ended")
            tiny_row = page.locator("#pairs [role=row]", has_text="Tiny test pair")
            wait_for(lambda: "yes" in tiny_row.inner_text(), timeout=10, what="the table to show it downloaded")
            page.screenshot(path=str(ARTIFACTS / "browser-models-download.png"), full_page=True)
            wait_for(lambda: "Loaded: embedded" in page.locator("#model-status").inner_text(), timeout=60,
                     what="the embedded model to load")
            wait_for(lambda: "embedded at 8,192 tokens" in page.locator("#plan").inner_text(), timeout=10,
                     what="its plan")
            page.locator("#use-pair").click()
            wait_for(lambda: "Loaded: tiny" in page.locator("#model-status").inner_text(), timeout=60,
                     what="the downloaded pair to load")
            wait_for(lambda: "tiny at 256 tokens" in page.locator("#plan").inner_text(), timeout=10,
                     what="its plan")
            assert "CPU" in page.locator("#profile").inner_text()
            page.screenshot(path=str(ARTIFACTS / "browser-models-panel.png"), full_page=True)
        finally:
            browser.close()
            demo.close()


# ---- the Chat tab's model line ------------------------------------------------------------------


def test_the_demonstration_model_says_so_and_one_click_downloads_the_recommended_pair_and_switches(
        hub, caches, models_file, monkeypatch):
    from specchat.app import model_notice
    from specchat.app.model_notice import ModelNotice

    # The registry's real pairs are larger (the choice among them is the next test's); the stand-in
    # Hub serves the tiny pair, so that is the one recommended here.
    tiny = load_registry(models_file).get("tiny")
    monkeypatch.setattr(model_notice, "recommendation", lambda registry_file, profile: (tiny, "Get Tiny test pair."))
    asked = []
    handle = EngineHandle(lambda model, progress: asked.append(model) or SimpleNamespace(), "embedded")
    profile = HardwareProfile.load(PROFILES / "rtx4090-24gb.json")
    notice = ModelNotice(handle, str(models_file), PairDownload(hub.endpoint), profile=lambda: profile)
    line = wait_for(lambda: "Tiny test pair" in notice.line() and notice.line(), timeout=30, what="the advice")
    assert "demonstration model" in line and notice.offers_download() and notice.recommended.id == "tiny"
    with hub_online():
        assert notice.get_recommended() == ""
        wait_for(lambda: handle.model == "tiny", timeout=60, what="the switch after the download")
    wait_for(lambda: handle.status() == "ready", timeout=30, what="the new pair")
    assert asked == ["embedded", "tiny"] and notice.line() == "Model: **Tiny test pair** · ready"
    assert not notice.offers_download()


def test_a_download_that_ends_after_the_user_chose_another_model_switches_nothing(models_file):
    """The one-click pair downloads in the background: a pair the user chose meanwhile ("Use this
    pair") was replaced when the download ended."""
    from specchat.app.model_notice import ModelNotice

    handle = EngineHandle(lambda model, progress: f"engine:{model}", "embedded")
    finished = SimpleNamespace(downloading=lambda pair_id: False,
                               snapshot=lambda: SimpleNamespace(pair_id="tiny", state="downloaded"))
    profile = HardwareProfile.load(PROFILES / "rtx4090-24gb.json")
    notice = ModelNotice(handle, str(models_file), finished, profile=lambda: profile)
    tiny = load_registry(models_file).get("tiny")
    handle.get(10)
    handle.switch("user-choice")  # while the download ran
    notice._switch_when_downloaded(tiny, "embedded")
    assert handle.model == "user-choice" and handle.get(10) == "engine:user-choice"
    notice._switch_when_downloaded(tiny, "user-choice")  # nothing chosen meanwhile: it switches
    assert handle.model == "tiny"


def test_without_a_pair_that_runs_well_the_line_says_why():
    from specchat.app.model_notice import recommendation

    pair, why = recommendation(None, HardwareProfile.load(PROFILES / "cpu-only-32gb.json"))
    assert pair is None and "need a CUDA GPU" in why and "Qwen2.5 7B" in why
    pair, why = recommendation(None, HardwareProfile.load(PROFILES / "rtx4090-24gb.json"))
    assert pair is not None and pair.id in why or pair.name in why
