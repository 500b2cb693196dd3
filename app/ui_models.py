"""The app's "Models & hardware" tab: every registry pair with its fit and download status,
downloads with live progress and cancel, switching the loaded pair, this machine's hardware
profile, the loaded engine's plan and its self-test.

The state (a background download, the cached profile) and the rendering are plain classes and
functions, tested without a browser; `build_models_tab` only wires them to components and polls
them once a second, sending a component only what changed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.model_cache import model_status
from ..core.errors import SpecchatError, first_line
from ..core.files import human_size
from ..core.hardware import HardwareProfile, load_or_probe
from ..core.planning import Overrides, PlanRefused, make_plan, precision_setting
from ..core.registry import ModelPair, Registry, load_registry
from ..core.selftest import run_selftest
from .engine_handle import EngineHandle
from .models_cmd import listing_profile, pair_row
from .pair_download import PairDownload, download_markdown
from .plan_cmd import plan_markdown, profile_markdown
from .selftest_cmd import report_markdown

if TYPE_CHECKING:
    import gradio as gr

    from ..core.engine import Engine

POLL_SECONDS = 1.0
# What the embedded model is for, in the chat's model line and the pairs table alike.
EMBEDDED_NOTE = ("A small offline demonstration model (135M parameters): it shows how specchat works, but its "
                 "answers can repeat themselves or be wrong.")
PROFILE_WAIT_SECONDS = 2.0  # for the first read of the profile, before the pairs table probes without it
PAIR_COLUMNS = ["ID", "Pair", "Context", "Size", "Fits this machine", "What it means", "On disk"]
# The reasons are the long cells; the others are wide enough for an unbroken id or number at 800 px.
PAIR_COLUMN_WIDTHS = ["12%", "19%", "11%", "8%", "12%", "28%", "10%"]
# In a narrower window each column keeps its width in an 800 px window's 700 px table, and the table
# scrolls sideways: squeezed to their share of a 400 px window, cells cut words. Gradio draws each
# column as body cells, a header cell and the header's sizing cell.
PAIRS_TABLE_MIN_PX = 700
PAIRS_TABLE_CSS = "".join(
    f"#pairs .body-cell:nth-child({column}), #pairs th:nth-child({column}), #pairs td:nth-child({column}) "
    f"{{ min-width: {round(PAIRS_TABLE_MIN_PX * float(width.rstrip('%')) / 100)}px !important; }}\n"
    for column, width in enumerate(PAIR_COLUMN_WIDTHS, 1))


# ---- the hardware profile -------------------------------------------------------------------


def _read_profile(refresh: bool) -> HardwareProfile:
    return load_or_probe(refresh=refresh)


class ProfileHolder:
    """This machine's hardware profile, read once in the background from specchat's cache (measured
    only when nothing is cached yet), never again on a page load; `measure_again` refreshes it."""

    def __init__(self, read: Callable[[bool], HardwareProfile] = _read_profile):
        self._read = read
        self._lock = threading.Lock()
        self._first_read = threading.Event()
        self._profile: HardwareProfile | None = None
        self._error = ""
        self._measuring = True
        threading.Thread(target=self._load, args=(False,), daemon=True, name="hardware-profile").start()

    def _load(self, refresh: bool) -> None:
        profile, error = None, ""
        try:
            profile = self._read(refresh)
        except Exception as failure:  # shown in the tab; the chat does not need it
            error = f"{type(failure).__name__}: {first_line(failure)}"
        with self._lock:
            self._profile, self._error = profile or self._profile, error
            self._measuring = False
        self._first_read.set()

    def get(self, timeout: float | None = None) -> HardwareProfile | None:
        """The profile, after waiting up to `timeout` for the first read; None if there is none."""
        self._first_read.wait(timeout)
        with self._lock:
            return self._profile

    def measure_again(self) -> str:
        """"" when a measurement starts (the profile panel says so), else why not."""
        with self._lock:
            if self._measuring:
                return "The profile is being measured: wait a moment."
            self._measuring = True
        threading.Thread(target=self._load, args=(True,), daemon=True, name="hardware-profile").start()
        return ""

    def markdown(self) -> str:
        with self._lock:
            profile, error, measuring = self._profile, self._error, self._measuring
        if profile is None:
            return f"⚠️ The hardware profile could not be read: {error}" if error else \
                "Reading this machine's hardware profile…"
        notes = (["*Measuring again (seconds; longer with GPUs)…*"] if measuring else []) + \
            ([f"⚠️ Measuring again failed: {error}"] if error else [])
        return "\n\n".join([profile_markdown(profile), *notes])


# ---- the loaded model and its plan ----------------------------------------------------------


def model_label(model: str, registry: Registry) -> str:
    pair = registry.pairs.get(model)
    return f"**{model}** ({pair.name})" if pair else f"`{model}`"


def status_markdown(handle: EngineHandle, registry: Registry) -> str:
    label, status = model_label(handle.model, registry), handle.status()
    if status == "loading":
        progress = handle.progress()
        return f"Loading {label}…" + (f" {progress}" if progress else "")
    if status == "ready":
        notes = " · ".join(filter(None, [handle.switch_note(), handle.calibration_note()]))
        return f"Loaded: {label}" + (f" · {notes}" if notes else "")
    return f"⚠️ {label} could not be loaded: {status.removeprefix('failed: ')}"


def engine_plan_markdown(engine: Engine) -> str:
    """The plan the engine was loaded with; without one (a local model folder, or a pair that fits
    nowhere) what runs, briefly."""
    if engine.plan is not None:
        return plan_markdown(engine.plan)
    draft = f", drafted by `{engine.draft_name}`" if engine.draft is not None else ""
    dtype = str(engine.model.dtype).removeprefix("torch.")
    return (f"`{engine.name}` runs without a plan: {engine.auto_mode} decoding when the mode is auto, "
            f"{dtype} weights on {engine.model.device}{draft}.")


def loaded_plan_markdown(handle: EngineHandle) -> str:
    if handle.status() != "ready":
        return "The plan shows once a model is loaded."
    try:
        return engine_plan_markdown(handle.get(timeout=0))
    except SpecchatError:  # switched to another model since the status was read
        return "The plan shows once a model is loaded."


def switch_refusal(pair: ModelPair, registry: Registry, profile: HardwareProfile | None,
                   downloads: PairDownload) -> str | None:
    """Why `pair` cannot be loaded now, as Markdown, or None when it can: it must fit this machine
    (the plan at the pair's full context, as loading plans it) and be downloaded."""
    if profile is not None:
        try:
            make_plan(profile, pair, pair.context_length, Overrides(precision=precision_setting()), registry=registry)
        except PlanRefused as refusal:
            return f"⚠️ {refusal}"
    if pair.source != "hub" or all(model_status(model).complete for model in pair.models):
        return None
    downloading = downloads.still_downloading(pair.id)
    if downloading:
        return downloading
    return f"**{pair.id}** is not downloaded: download it first ({human_size(pair.download_bytes)})."


def _meaning(row: dict) -> str:
    """The pair's fit in everyday words; the embedded model says what it is for, as the chat does."""
    if row["source"] == "embedded":
        return f"{EMBEDDED_NOTE} {row['fit_plain']}"
    return row["fit_plain"]


# ---- the tab's state, shared by every browser session ---------------------------------------


class ModelsPanel:
    """What the tab shows and does; each method returns what a component shows."""

    def __init__(self, handle: EngineHandle, registry: Registry, downloads: PairDownload | None = None,
                 profiles: ProfileHolder | None = None):
        self.handle, self.registry = handle, registry
        self.downloads = downloads or PairDownload()
        self.profiles = profiles or ProfileHolder()

    def pair_table(self, technical: bool = False) -> list[list[str]]:
        """Every pair with its fit: the plan at its full context on the profile that "Use this pair"
        checks, or, while that is still being measured, on a probe without measurement (the same
        memory sizes, so the same verdicts). Why, in everyday words, or the plan's own `technical`."""
        profile = self.profiles.get(timeout=PROFILE_WAIT_SECONDS) or listing_profile()
        rows = [pair_row(pair, profile, self.registry) for pair in self.registry.pairs.values()]
        return [[row["id"], row["name"], f"{row['context_length']:,}", row["download"], row["fit"],
                 row["fit_reason"] if technical else _meaning(row), row["status"]] for row in rows]

    def poll(self, message: str = "") -> dict[str, object]:
        """What the polled components show now. The pairs table reads the disk, so instead of it
        the count of ended downloads: the table is read again when that changes. `message`, the
        line under the buttons, is kept unless it is a refusal because a download ran ("still
        downloading") and that download has ended: then "" (the progress line says how it ended)."""
        return {"status": status_markdown(self.handle, self.registry),
                "download": download_markdown(self.downloads.snapshot()),
                "plan": loaded_plan_markdown(self.handle), "profile": self.profiles.markdown(),
                "downloads_ended": self.downloads.ended,
                "message": "" if message and self.downloads.outdated(message) else message}

    def download(self, pair_id: str | None) -> str:
        if not pair_id:
            return "Pick a pair first."
        return self.downloads.start(self.registry.get(pair_id))

    def use(self, pair_id: str | None) -> str:
        """Load `pair_id` in the background: "" when it starts (the status line shows it), else why not."""
        if not pair_id:
            return "Pick a pair first."
        pair = self.registry.get(pair_id)
        profile = self.profiles.get(timeout=PROFILE_WAIT_SECONDS) or listing_profile()  # first launch measures
        refusal = switch_refusal(pair, self.registry, profile, self.downloads)
        if refusal:
            return refusal
        status = self.handle.status()
        if pair_id == self.handle.model and status in ("loading", "ready"):
            return f"**{pair_id}** is already {'loading' if status == 'loading' else 'loaded'}."
        self.handle.switch(pair_id)
        return ""

    def self_test(self) -> str:
        """`specchat selftest` on the loaded engine, as Markdown. It runs through `handle.call`,
        on the engine's own thread, so never beside an answer (which would share its caches)."""
        if self.handle.status() != "ready":
            return "The self-test runs on the loaded model: wait until one is loaded."
        try:
            name, results = self.handle.call(lambda engine: (engine.name, run_selftest(engine)))
        except SpecchatError as error:  # the model was switched or failed meanwhile
            return f"⚠️ {error}"
        return report_markdown(name, results)


# ---- the Gradio wiring ------------------------------------------------------------------------


def build_models_tab(handle: EngineHandle, registry_file: str | None, downloads: PairDownload | None = None,
                     shown_by: tuple[gr.Tab, list[gr.Tab]] | None = None) -> None:
    """The tab's components and events, inside the caller's `gr.Tab`. `downloads` defaults to
    downloads from the Hub huggingface_hub is configured for (tests pass a stand-in's). With
    `shown_by` (this `gr.Tab` and the tabs beside it) the tab polls only while shown; without it,
    the tab is the page and always polls."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    panel = ModelsPanel(handle, load_registry(registry_file), downloads)
    polled = ("status", "download", "plan", "profile")

    gr.Markdown("### Model pairs\nWhether a pair fits is its plan at its full context on this machine, as "
                "`specchat plan` shows it; **Use this pair** loads that plan.")
    status = gr.Markdown(lambda: status_markdown(handle, panel.registry), elem_id="model-status")
    table = gr.Dataframe(panel.pair_table, headers=PAIR_COLUMNS, column_widths=PAIR_COLUMN_WIDTHS, interactive=False,
                         wrap=True, elem_id="pairs")
    technical = gr.Checkbox(False, label="Technical reasons (weights, KV cache, memory per device)",
                            elem_id="technical-reasons")
    with gr.Row():
        picker = gr.Dropdown([(f"{pair.id}: {pair.name}", pair.id) for pair in panel.registry.pairs.values()],
                             value=handle.model if handle.model in panel.registry.pairs else None,
                             label="Pair", scale=3, elem_id="pair-picker")
        download = gr.Button("Download", scale=1, elem_id="download")
        cancel = gr.Button("Cancel download", variant="stop", scale=1, elem_id="cancel-download")
        use = gr.Button("Use this pair", variant="primary", scale=1, elem_id="use-pair")
    message = gr.Markdown("", elem_id="pair-message")
    progress = gr.Markdown(lambda: download_markdown(panel.downloads.snapshot()), elem_id="download-progress")
    gr.Markdown("### This machine")
    profile = gr.Markdown(panel.profiles.markdown, elem_id="profile")
    measure = gr.Button("Measure again", size="sm", elem_id="measure-again")
    gr.Markdown("### The plan of the loaded model")
    plan = gr.Markdown(lambda: loaded_plan_markdown(handle), elem_id="plan")
    gr.Markdown("### Self-test\nChecks on this machine that decoding is lossless with the loaded model: the "
                "verification rules, every decoding mode against plain decoding, the GPU paths (under a minute "
                "on a small model; answers wait meanwhile).")
    run_test = gr.Button("Run the self-test", size="sm", elem_id="run-selftest")
    test_report = gr.Markdown("", elem_id="selftest-report")
    shown = gr.State({})  # what this session's components show, so a poll sends only changes

    def refresh(before: dict, detail: bool, shown_message: str | None):
        now = panel.poll(shown_message or "")
        values = [gr.skip() if before.get(key) == now[key] else now[key] for key in polled]
        rows = gr.skip() if before.get("downloads_ended") == now["downloads_ended"] else panel.pair_table(detail)
        note = gr.skip() if now["message"] == (shown_message or "") else now["message"]
        return *values, rows, now, note

    inputs, outputs = [shown, technical, message], [status, progress, plan, profile, table, shown, message]
    poll = gr.Timer(POLL_SECONDS, active=shown_by is None)
    poll.tick(refresh, inputs, outputs, show_progress="hidden")
    if shown_by is not None:  # a hidden tab's poll would cost the browser and the server a redraw a second
        tab, others = shown_by
        # Shown again: everything read anew, the pairs table too (`specchat models` may have changed the disk).
        tab.select(lambda: (gr.Timer(active=True), {}), None, [poll, shown], queue=False,
                   show_progress="hidden").then(refresh, inputs, outputs, show_progress="hidden")
        for other in others:
            other.select(lambda: gr.Timer(active=False), None, poll, queue=False, show_progress="hidden")
    technical.change(panel.pair_table, technical, table, show_progress="hidden")
    # After a button, poll at once rather than within the second.
    for button, action, picked in ((download, panel.download, picker), (cancel, panel.downloads.cancel, None),
                                   (use, panel.use, picker), (measure, panel.profiles.measure_again, None)):
        button.click(action, picked, message).then(refresh, inputs, outputs, show_progress="hidden")
    run_test.click(panel.self_test, None, test_report)
