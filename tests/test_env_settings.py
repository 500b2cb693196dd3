"""Every environment setting is read one way: unset is the default, a bad value names the variable."""

import pytest

from specchat.core.env_settings import env_number
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


@pytest.mark.parametrize("raw", ["twelve", "0", "-3", "inf", "1.5"])
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
