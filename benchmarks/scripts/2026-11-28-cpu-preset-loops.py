"""Issue 40's loop check through the public command: `specchat generate --document FILE --preset
summarize --seed S` on four public documents of 2.8-5.9K tokens that played no part in choosing
the preset's penalty but MPL-2.0 (Apache-2.0 and MPL-2.0 did: 2026-11-27-cpu-repetition.py), seeds 0-2, generate's default answer limit of 256 tokens, the embedded
model. An answer loops if it repeats a run of 12 tokens 3 times (core/repeats.py `repeat_end`),
counted on its tokens, so an answer the preset's guard ended counts as looping too.
Run: .venv/bin/python benchmarks/scripts/2026-11-28-cpu-preset-loops.py > bench/2026-11-28-cpu-preset-loops.json"""
import json
import subprocess
import sys
import time
from pathlib import Path

from specchat.core.repeats import repeat_end

DOCUMENTS = ["numpy-ma-readme.rst", "mpl-2.0.txt", "http-proxy-readme.md", "lgpl-2.1.txt"]
FOLDER = Path("tests/data/documents")
SPECCHAT = str(Path(sys.executable).parent / "specchat")
NEW_TOKENS = 256  # `generate`'s default answer limit

rows, started = [], time.time()
for name in DOCUMENTS:
    for seed in range(3):
        command = [SPECCHAT, "generate", "--document", str(FOLDER / name), "--preset", "summarize", "--seed", str(seed),
                   "--max-new-tokens", str(NEW_TOKENS), "--cache-document", "--json"]
        completed = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(completed.stdout)
        end = repeat_end(result["token_ids"])
        rows.append({"document": name, "prompt_tokens": result["prompt_tokens"], "seed": seed,
                     "new_tokens": result["new_tokens"], "finish_reason": result["finish_reason"],
                     "loops": end is not None, "repeat_ends_at": end, "mode": result["mode"],
                     "tokens_per_second": round(result["stats"]["tokens_per_second"], 2),
                     "text_start": result["text"][:200]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, and what a cut-short run found
print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": "CPU (2 cores, this VM, shared with other work)",
                  "model": "embedded SmolLM2-135M-Instruct",
                  "command": f"specchat generate --document FILE --preset summarize --seed S --max-new-tokens {NEW_TOKENS} "
                             "--cache-document --json",
                  "seeds": [0, 1, 2], "loop": "repeats a run of 12 tokens 3 times, not overlapping (core/repeats.py)",
                  "seconds": round(time.time() - started),
                  "summary": {"answers": len(rows), "looping": sum(r["loops"] for r in rows),
                              "ended_on_their_own": sum(r["finish_reason"] == "stop" for r in rows),
                              "stopped_by_the_guard": sum(r["finish_reason"] == "repeating" for r in rows)},
                  "rows": rows}, indent=1))
