"""How much the embedded model repeats itself in a document summary, greedy vs sampled
(the document presets' sampling settings, app/presets.py). CPU, 300 new tokens, auto mode.
Run: SPECCHAT_CALIBRATE=0 python benchmarks/scripts/2026-11-23-cpu-summary-loops.py DOC... > bench/2026-11-23-cpu-summary-loops.json"""
import json
import sys
from specchat.core.loading import load_engine
from specchat.core.sampling import SamplingParams
from specchat.core.engine import Finished
from specchat.core.request import Request
from specchat.app.presets import PRESETS
from specchat.app.documents import user_turn

def repeated_share(text, n=6):
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / max(len(grams), 1)

engine = load_engine("embedded")
docs = sys.argv[1:]
rows = []
for path in docs:
    doc = open(path).read()
    messages = [{"role": "system", "content": PRESETS["summarize"].system},
                {"role": "user", "content": user_turn("Summarize this document.", doc)}]
    ids = engine.chat_ids(messages)
    for label, params in [("greedy", SamplingParams(0.0, 0, 1.0, None))] + [
            (f"T{t} p{p} s{s}", SamplingParams(t, 0, p, s)) for t, p in ((0.3, 0.9), (0.7, 0.9)) for s in (1, 2)]:
        for event in engine.generate(ids, Request(300, params, "auto")):
            if isinstance(event, Finished):
                r = event.result
        rows.append({"document": path.split("/")[-1], "sampling": label, "new_tokens": r.new_tokens,
                     "finish_reason": r.finish_reason, "repeated_6gram_share": round(repeated_share(r.text), 3),
                     "tokens_per_second": round(r.stats.tokens_per_second, 1), "text_start": r.text[:300]})
print(json.dumps({"date": "2026-11-23", "device": "CPU (2 cores, this VM)", "model": "embedded SmolLM2-135M-Instruct",
                  "preset": "summarize", "max_new_tokens": 300,
                  "metric": "share of the answer's 6-word runs that repeat an earlier one (0 = none)",
                  "rows": rows}, indent=1))
