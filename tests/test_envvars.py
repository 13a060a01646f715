"""Integer environment variables: defaults, parsing, bounds, errors naming the variable."""
import pytest

from wanlink.envvars import env_int
from wanlink.errors import ConfigError


def test_env_int(monkeypatch):
    monkeypatch.delenv("WANLINK_TEST_INT", raising=False)
    assert env_int("WANLINK_TEST_INT", 7) == 7
    monkeypatch.setenv("WANLINK_TEST_INT", "42")
    assert env_int("WANLINK_TEST_INT", 7) == 42
    monkeypatch.setenv("WANLINK_TEST_INT", "lots")
    with pytest.raises(ConfigError, match="WANLINK_TEST_INT must be an integer"):
        env_int("WANLINK_TEST_INT", 7)
    monkeypatch.setenv("WANLINK_TEST_INT", "-1")
    with pytest.raises(ConfigError, match="WANLINK_TEST_INT must be >= 0"):
        env_int("WANLINK_TEST_INT", 7)
