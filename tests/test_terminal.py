import io
from types import SimpleNamespace

from specchat.app.terminal import run_chat
from specchat.core.loading import load_engine


def chat_args(**overrides):
    args = dict(system=None, max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, mode="auto",
                dsi_workers=None, dsi_always=False)
    return SimpleNamespace(**{**args, **overrides})


def test_conversation_keeps_history_and_survives_errors(tiny_model_dir):
    engine = load_engine(str(tiny_model_dir))
    seen = []
    original = engine.chat_ids
    engine.chat_ids = lambda messages: seen.append(list(messages)) or original(messages)
    long_message = "word " * 400  # beyond the tiny model's 256-token context
    stdin = io.StringIO(f"Hello\n{long_message}\nAgain\n/reset\nFresh start\n/exit\n")
    stdout = io.StringIO()
    assert run_chat(engine, chat_args(), stdin=stdin, stdout=stdout) == 0
    output = stdout.getvalue()
    assert "error:" in output and "reads at most 256" in output
    assert "cut off at the answer limit]" in output  # 8 tokens, far from the context's end
    # The failed turn was not recorded; the second question still sees the first exchange.
    assert [m["role"] for m in seen[2]] == ["user", "assistant", "user"]
    assert seen[2][0]["content"] == "Hello" and seen[2][2]["content"] == "Again"
    # /reset started over.
    assert [m["content"] for m in seen[3]] == ["Fresh start"]
