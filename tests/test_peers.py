"""The peers suite (benchmarks/peers.py): transformers' greedy generate and prompt lookup timed by
a streamer beside specchat plain and auto, end to end on a tiny model."""

import json

import torch

from specchat.benchmarks.peers import HF_RUNS, SPECCHAT_RUNS, hf_answer


def test_the_clock_sees_every_new_token_even_several_at_once(tiny_model_dir):
    """Prompt lookup hands the streamer several tokens per put: all of them count, and greedy
    lookup writes greedy's answer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    greedy, greedy_speed = hf_answer(model, prompt, 20, None)
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                  pad_token_id=model.generation_config.eos_token_id)[0, len(prompt):].tolist()
    assert greedy == expected and greedy_speed > 0
    looked_up, _ = hf_answer(model, prompt, 20, 10)
    assert looked_up == greedy


def test_the_suite_runs_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path):
    from specchat.app.cli import main

    documents = []
    for name, text in (("cat.txt", "The cat sat on the mat. The cat sat on the hat. " * 3),
                       ("dog.txt", "A dog ran in the park, then a dog ran home. " * 3)):
        documents.append(tmp_path / name)
        documents[-1].write_text(text)
    assert main(["bench", "--suite", "peers", "--model", str(tiny_model_dir), "--documents", *map(str, documents),
                 "--max-new-tokens", "12", "--repeats", "2", "--out", str(tmp_path / "out")]) == 0
    [written] = (tmp_path / "out").glob("*-peers.json")
    report = json.loads(written.read_text())
    assert list(report["documents"]) == ["cat.txt", "dog.txt"] and report["repeats"] == 2
    for row in report["documents"].values():
        assert set(row["tokens_per_second"]) == set(SPECCHAT_RUNS) | set(HF_RUNS)
        assert all(len(runs) == 2 and min(runs) > 0 for runs in row["tokens_per_second_runs"].values())
        assert row["auto_identical_to_plain"] and row["best_hf_lookup"].startswith("HF prompt lookup")
        assert row["auto_over_best_hf_lookup"] == (row["tokens_per_second"]["specchat auto"]
                                                   / row["tokens_per_second"][row["best_hf_lookup"]])
    assert report["auto_identical_to_plain_everywhere"] is True
