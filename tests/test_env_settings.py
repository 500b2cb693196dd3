"""Every environment setting is read one way: unset is the default, a bad value names the variable."""

import pytest

from specchat.core.env_settings import env_number, env_switch, folder_setting
from specchat.core.errors import InputError
from specchat.core.hardware import vram_limit_bytes
from specchat.core.limits import UPLOAD


def test_unset_or_blank_is_the_default_and_a_good_value_is_read(monkeypatch):
    monkeypatch.delenv("SPECCHAT_TEST_SETTING", raising=False)
    assert env_number("SPECCHAT_TEST_SETTING", 7, int) == 7
    monkeypatch.setenv("SPECCHAT_TEST_SETTING", "  ")
    assert env_number("SPECCHAT_TEST_SETTING", 7, int) == 7
    monkeypatch.setenv("SPECCHAT_TEST_SETTING", "12")
    assert env_number("SPECCHAT_TEST_SETTING", 7, int) == 12


@pytest.mark.parametrize("raw", ["twelve", "0", "-3", "inf", "1.5", "nan", "1e13"])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv("SPECCHAT_TEST_SETTING", raw)
    with pytest.raises(InputError, match=r"SPECCHAT_TEST_SETTING must be a positive whole number"):
        env_number("SPECCHAT_TEST_SETTING", 7, int)


def test_the_limits_and_the_vram_cap_read_the_same_way(monkeypatch):
    monkeypatch.setenv(UPLOAD.variable, "oops")
    with pytest.raises(InputError, match=UPLOAD.variable):
        UPLOAD.bytes  # a typo no longer falls back to the default silently
    monkeypatch.setenv(UPLOAD.variable, "2")
    assert UPLOAD.bytes == 2_000_000
    monkeypatch.setenv("SPECCHAT_VRAM_LIMIT", "0.25")
    with pytest.raises(InputError, match="SPECCHAT_VRAM_LIMIT must be the GB"):
        vram_limit_bytes()
    monkeypatch.setenv("SPECCHAT_VRAM_LIMIT", "8")
    assert vram_limit_bytes() == 8 * 2**30


def test_a_number_past_any_setting_is_refused_before_it_is_scaled(monkeypatch):
    """1e308 GB or MB became infinity once scaled to bytes (OverflowError, exit 1)."""
    monkeypatch.setenv("SPECCHAT_VRAM_LIMIT", "1e308")
    with pytest.raises(InputError, match="SPECCHAT_VRAM_LIMIT .* up to 1e"):
        vram_limit_bytes()
    monkeypatch.setenv(UPLOAD.variable, "1e303")
    with pytest.raises(InputError, match=UPLOAD.variable):
        UPLOAD.bytes


@pytest.mark.parametrize("raw, on", [("", True), ("0", False), ("off", False), ("No", False), ("false", False),
                                     ("1", True), ("on", True), ("TRUE", True)])
def test_a_switch_reads_the_usual_words(monkeypatch, raw, on):
    monkeypatch.setenv("SPECCHAT_TEST_SWITCH", raw)
    assert env_switch("SPECCHAT_TEST_SWITCH", True) is on


def test_a_switch_with_a_typo_is_an_error_not_the_default(monkeypatch):
    """SPECCHAT_CALIBRATE=off once started the three-minute calibration it meant to skip."""
    monkeypatch.setenv("SPECCHAT_TEST_SWITCH", "of")
    with pytest.raises(InputError, match="SPECCHAT_TEST_SWITCH must be one of 1, on, yes, true, 0, off"):
        env_switch("SPECCHAT_TEST_SWITCH", True)


def test_a_folder_setting_that_names_a_file_says_so(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="SPECCHAT_CACHE_DIR is .*file, which is a file, not a folder"):
        folder_setting("SPECCHAT_CACHE_DIR", str(tmp_path / "file"))
    assert folder_setting("SPECCHAT_CACHE_DIR", str(tmp_path / "new")) == tmp_path / "new"
