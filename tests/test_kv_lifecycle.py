"""What the chat page leaves behind of an answer's KV, on the tiny model (256-token context): one
KV in memory per conversation whatever Retry, Edit or a turn left out change; the latest document's
KV saved to disk wherever it was attached; and a deleted conversation's saved documents deleted with
it, never one that another conversation still uses."""

import dataclasses

from conftest import DATA, run
from specchat.app.chat_view import Settings

SETTINGS = Settings(system="", preset="free", temperature=0.0, top_p=1.0, top_k=0, seed=None,
                    max_new_tokens=16, mode="plain")
DOCUMENT = (DATA / "apache-2.0.txt").read_text()[:400].strip()  # about 80 tokens


def test_retry_and_edit_take_the_conversation_s_kv_back_instead_of_copying_it(logic):
    """Retry and Edit start the prompt anew after the document: each kept a copy of the shared
    prefix beside the old entry (t6: +1,087 MB over 25 turns on the embedded model)."""
    engine = logic.handle.get()
    conversation = run(logic.send("What is this?", None, DOCUMENT, None, SETTINGS))[-1].conversation
    other = run(logic.send("Who wrote this?", None, DOCUMENT, None, SETTINGS))[-1].conversation
    assert len(engine.prefixes) == 2
    sampled = dataclasses.replace(SETTINGS, temperature=1.0)
    for seed in (1, 2):
        conversation = run(logic.regenerate(conversation, dataclasses.replace(sampled, seed=seed)))[-1].conversation
    conversation = run(logic.edit(conversation, 0, "Who may use it?", SETTINGS))[-1].conversation
    stats = conversation.messages[-1]["stats"]
    assert stats["reused_from"] == "memory" and stats["reused_prompt_tokens"] >= 60  # the document, from memory
    assert sorted(entry.owner for entry in engine.prefixes._entries) == sorted([conversation.id, other.id])
    # The other conversation kept its own KV all along.
    other = run(logic.send("And then?", None, "", other, SETTINGS))[-1].conversation
    assert other.messages[-1]["stats"]["reused_prompt_tokens"] >= len(engine.chat_ids(
        [{"role": "user", "content": f"{DOCUMENT}\n\nWho wrote this?"}]))
