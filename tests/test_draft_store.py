"""Drafts kept on disk per browser (`app/draft_store.py`): what the page restores after a reload
or a server restart; the browser tests drive it through the page."""

from specchat.app.draft_store import KEPT_DRAFTS, DraftStore

DRAFT = {"message": "Who owns it?", "attachment": {"name": "notes.txt", "text": "Priya.", "tokens": 3, "note": ""},
         "pasted": ""}


def test_a_browser_gets_its_drafts_back_and_an_empty_set_leaves_no_file(tmp_path):
    store = DraftStore(tmp_path)
    browser = store.browser("")
    assert store.browser(browser) == browser and store.browser(None) != browser
    store.save(browser, {"abc": DRAFT, "": {"message": "new one", "attachment": None, "pasted": "text"}})
    assert DraftStore(tmp_path).load(browser) == {"abc": DRAFT, "": {"message": "new one", "attachment": None,
                                                                     "pasted": "text"}}
    store.save(browser, {})
    assert list(tmp_path.iterdir()) == [] and store.load(browser) == {}


def test_a_value_that_is_no_id_names_no_file(tmp_path):
    store = DraftStore(tmp_path)
    for sent in ("../../conversations/x", "ABC", 42, "0" * 31):
        assert store.browser(sent) != sent  # a new id instead: the value is never a path


def test_a_damaged_file_is_no_draft_and_no_error(tmp_path):
    store = DraftStore(tmp_path)
    browser = store.browser("")
    for text in ("{not json", '{"abc": {"message": 3}}', "[1, 2]"):
        (tmp_path / f"{browser}.json").write_text(text)
        assert store.load(browser) == {}


def test_the_newest_drafts_are_kept(tmp_path):
    store = DraftStore(tmp_path)
    browser = store.browser("")
    store.save(browser, {f"c{index}": DRAFT for index in range(KEPT_DRAFTS + 5)})
    assert list(store.load(browser)) == [f"c{index}" for index in range(5, KEPT_DRAFTS + 5)]
