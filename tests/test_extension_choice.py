"""The compiled-or-reference choice shared by the kernels and the frame decoder (wanlink._choice)."""
import sys
import types
import warnings

import pytest

from wanlink._choice import Choice
from wanlink.errors import ConfigError, UnsupportedError

MODULE = "wanlink._choice_test_extension"
REFERENCE = object()


@pytest.fixture
def extension(monkeypatch):
    """A stand-in compiled module carrying ABI 3 and a class to take."""
    module = types.ModuleType(MODULE)
    module.ABI, module.Thing = 3, type("Thing", (), {})
    monkeypatch.setitem(sys.modules, MODULE, module)
    monkeypatch.delenv("WANLINK_PUREPYTHON", raising=False)
    return module


def choose(**options) -> Choice:
    return Choice("gadget", MODULE, "ABI", 3, REFERENCE, **options)


def test_a_matching_build_is_chosen_and_take_picks_what_callers_use(extension):
    choice = choose(take=lambda module: module.Thing)
    assert choice.available() == ["compiled", "reference"] and choice.name == "compiled"
    assert choice.active is extension.Thing
    assert choice.use("reference") == "compiled" and choice.active is REFERENCE and choice.name == "reference"
    with pytest.raises(ConfigError, match="unknown gadget implementation 'fortran'"):
        choice.use("fortran")
    assert choice.name == "reference"


def test_a_stale_build_warns_with_the_advice_and_the_reference_runs(extension):
    extension.ABI = 2
    with pytest.warns(RuntimeWarning, match=r"stale \(ABI is 2, this wanlink needs 3\).*rebuild it"):
        choice = choose(advice="rebuild it")
    assert choice.available() == ["reference"] and choice.active is REFERENCE
    with pytest.raises(UnsupportedError, match="compiled gadget unavailable: .* is not built"):
        choice.load("compiled")


def test_a_stale_build_warns_even_where_a_missing_one_would_not(extension):
    extension.ABI = 2
    with pytest.warns(RuntimeWarning, match="stale"):
        choose(advice="rebuild it", warn_if_missing=False)


def test_a_missing_build_warns_only_with_advice_where_a_build_is_expected(monkeypatch):
    monkeypatch.setitem(sys.modules, MODULE, None)  # makes the import fail
    monkeypatch.delenv("WANLINK_PUREPYTHON", raising=False)
    with pytest.warns(RuntimeWarning, match="compiled gadget .* are missing"):
        assert choose(advice="install a compiler").name == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose().name == "reference"
        assert choose(advice="install a compiler", warn_if_missing=False).name == "reference"


def test_a_stale_build_with_no_advice_is_silent(extension):
    extension.ABI = 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose().name == "reference"


def test_the_variable_forces_the_reference_and_load_says_so(extension, monkeypatch):
    monkeypatch.setenv("WANLINK_PUREPYTHON", "1")
    choice = choose(advice="never shown")
    assert choice.available() == ["reference"]
    with pytest.raises(UnsupportedError, match="WANLINK_PUREPYTHON is set"):
        choice.load("compiled")
