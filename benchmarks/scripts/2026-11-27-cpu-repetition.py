"""Which repetition penalties stop the embedded model's summaries from looping: the Summarize
preset's prompt and sampling (temperature 0.7, top-p 0.9) on public documents, seeds 0-2,
256 new tokens, the repeat guard off; an answer loops if it repeats a run of 12 tokens 3 times
(core/repeats.py). CPU, auto mode (the distribution is the same in every mode).
Run: SPECCHAT_CALIBRATE=0 .venv/bin/python benchmarks/scripts/2026-11-27-cpu-repetition.py \
     tests/data/apache-2.0.txt tests/data/documents/mpl-2.0.txt > bench/2026-11-27-cpu-repetition.json"""
import json
import sys
import time

from specchat.app.documents import user_turn
from specchat.app.presets import PRESETS
from specchat.core.engine import Finished
from specchat.core.loading import load_engine
from specchat.core.repeats import repeat_end
from specchat.core.request import Request
from specchat.core.sampling import SamplingParams

SETTINGS = {"none": {}, "repetition 1.1": dict(repetition_penalty=1.1),
            "repetition 1.2": dict(repetition_penalty=1.2), "presence 0.5": dict(presence_penalty=0.5)}
NEW_TOKENS = 256


def repeated_share(text, n=6):
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / max(len(grams), 1)


engine = load_engine("embedded")
preset = PRESETS["summarize"]
rows, started = [], time.time()
for path in sys.argv[1:]:
    messages = [{"role": "system", "content": preset.system},
                {"role": "user", "content": user_turn(preset.question, open(path).read())}]
    ids = engine.chat_ids(messages)
    for label, penalties in SETTINGS.items():
        for seed in range(3):
            params = SamplingParams(0.7, 0, 0.9, seed, **penalties)
            result = next(e.result for e in engine.generate(ids, Request(NEW_TOKENS, params, "auto"))
                          if isinstance(e, Finished))
            end = repeat_end(result.token_ids)
            rows.append({"document": path.split("/")[-1], "prompt_tokens": len(ids), "setting": label, "seed": seed,
                         "new_tokens": result.new_tokens, "finish_reason": result.finish_reason,
                         "loops": end is not None, "guard_would_stop_at": end,
                         "repeated_6gram_share": round(repeated_share(result.text), 3),
                         "tokens_per_second": round(result.stats.tokens_per_second, 1), "text_start": result.text[:240]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, and what a cut-short run found
summary = {label: {"answers": sum(r["setting"] == label for r in rows),
                   "looping": sum(r["loops"] for r in rows if r["setting"] == label),
                   "ended_on_their_own": sum(r["finish_reason"] == "stop" for r in rows if r["setting"] == label),
                   "mean_repeated_6gram_share": round(sum(r["repeated_6gram_share"] for r in rows if r["setting"] == label)
                                                      / max(1, sum(r["setting"] == label for r in rows)), 3)}
           for label in SETTINGS}
print(json.dumps({"date": "2026-11-27", "device": "CPU (2 cores, this VM, shared)", "model": "embedded SmolLM2-135M-Instruct",
                  "preset": "summarize (temperature 0.7, top-p 0.9)", "max_new_tokens": NEW_TOKENS, "seeds": [0, 1, 2],
                  "loop": "the answer repeats a run of 12 tokens 3 times, not overlapping (core/repeats.py)",
                  "seconds": round(time.time() - started), "summary": summary, "rows": rows}, indent=1))
