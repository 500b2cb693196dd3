"""The Chat tab's model line: which model answers, its state, and, for the embedded model, the
plain truth that it is a small demonstration model, with the registry pair this machine runs best
and one click to download it and switch to it.

The recommendation comes from the plan (the same verdict as the Models tab): the largest pair that
fits this machine at its full context and does not run on the CPU at a crawl. It is worked out once,
in the background, as the plan probes the machine.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..core.errors import first_line
from ..core.files import human_size
from ..core.hardware import HardwareProfile
from ..core.registry import ModelPair, load_registry
from .engine_handle import EngineHandle
from .pair_download import PairDownload, download_markdown
from .ui_models import EMBEDDED_NOTE

EMBEDDED = "embedded"


def _listing_profile() -> HardwareProfile:
    from .models_cmd import listing_profile

    return listing_profile()


class ModelNotice:
    def __init__(self, handle: EngineHandle, registry_file: str | None = None, downloads: PairDownload | None = None,
                 profile: Callable[[], HardwareProfile] = _listing_profile):
        self.handle, self.registry_file = handle, registry_file
        self._pairs = load_registry(registry_file).pairs  # read once: the line is redrawn every tick
        self.downloads = downloads or PairDownload()
        self._profile = profile
        self._advice: str | None = None  # None until worked out
        self.recommended: ModelPair | None = None
        self._worked_out = threading.Event()
        threading.Thread(target=self._work_out_advice, daemon=True, name="model-advice").start()

    def offers_download(self) -> bool:
        """Whether the line offers the recommended pair (the embedded model is in use)."""
        return self.recommended is not None and self.handle.model == EMBEDDED

    def get_recommended(self) -> str:
        """Download the recommended pair, then switch to it: "" when started, else why not."""
        self._worked_out.wait(30)
        pair = self.recommended
        if pair is None:
            return "There is no pair to recommend for this machine."
        problem = self.downloads.start(pair)
        if problem:
            return problem
        threading.Thread(target=self._switch_when_downloaded, args=(pair, self.handle.model), daemon=True,
                         name=f"switch-to-{pair.id}").start()
        return ""

    def _switch_when_downloaded(self, pair: ModelPair, in_use: str) -> None:
        """Switch once the download ends, unless the user chose another model meanwhile."""
        while self.downloads.downloading(pair.id):
            threading.Event().wait(0.5)
        snapshot = self.downloads.snapshot()
        if snapshot.pair_id == pair.id and snapshot.state == "downloaded" and self.handle.model == in_use:
            self.handle.switch(pair.id)

    def line(self) -> str:
        pair = self._pairs.get(self.handle.model)
        name = f"**{pair.name if pair else self.handle.model}**"
        status = self.handle.status()
        if status == "loading":
            progress = self.handle.progress()
            return f"Model: {name} · ⏳ loading…" + (f" {progress}" if progress else "")
        if status != "ready":
            return f"⚠️ Model: {name} could not be loaded: {status.removeprefix('failed: ')}"
        ready = " · ".join(["ready", *filter(None, [self.handle.switch_note(), self.handle.calibration_note()])])
        if self.handle.model != EMBEDDED:
            return f"Model: {name} · {ready}"
        advice = self._advice if self._advice is not None else "Checking which larger pair this machine runs…"
        snapshot = self.downloads.snapshot()
        if self.recommended is not None and snapshot.pair_id == self.recommended.id and snapshot.state != "idle":
            advice = download_markdown(snapshot) + (" Switching to it…" if snapshot.state == "downloaded" else "")
        return f"Model: {name} · {ready} · *{EMBEDDED_NOTE[0].lower()}{EMBEDDED_NOTE[1:]}* {advice}"

    def _work_out_advice(self) -> None:
        try:
            self.recommended, self._advice = recommendation(self.registry_file, self._profile())
        except Exception as error:  # advice is optional: never let it break the chat
            self._advice = f"(Which larger pair fits could not be worked out: {first_line(error)})"
        self._worked_out.set()


def recommendation(registry_file: str | None, profile: HardwareProfile) -> tuple[ModelPair | None, str]:
    """The pair to use instead of the embedded one on this machine (None when none runs well) and
    one sentence saying so, or why there is none."""
    from .models_cmd import plan_fit

    registry = load_registry(registry_file)
    fits = [(pair, plan_fit(pair, profile, registry)) for pair in registry.pairs.values() if pair.source != EMBEDDED]
    fitting = [pair for pair, fit in fits if fit.fits]
    good = [pair for pair, fit in fits if fit.fits and not fit.slow]
    if good:
        best = max(good, key=lambda pair: (pair.download_bytes, pair.context_length))
        return best, (f"For real answers this machine runs **{best.name}** ({best.context_length:,}-token context, "
                      f"{human_size(best.download_bytes)} to download).")
    if fitting:
        names = ", ".join(pair.name for pair in fitting)
        return None, (f"Larger pairs need a CUDA GPU to be quick: on this machine's CPU {names} would fit but "
                      "answer slowly (see the *Models & hardware* tab).")
    return None, "No larger pair in the registry fits this machine (see the *Models & hardware* tab for why)."
