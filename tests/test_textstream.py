from transformers import AutoTokenizer

from specchat.core.textstream import TextStream


def test_streamed_text_equals_full_decode(embedded_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    text = "Naïve café — 東京 🚀 résumé: ∑ x² ≠ 0.\n  Indented line, then emoji 👩‍💻 done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer)
    pieces = [stream.add([token]) for token in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in pieces)  # never a half character
