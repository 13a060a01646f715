"""The one settings surface: parsing, clear errors, and the documentation table kept in step."""
import re
import tokenize
from pathlib import Path

import pytest

from wanlink import settings
from wanlink.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_empty_environment_gives_the_defaults():
    assert settings.from_env({}) == settings.Settings()


def test_values_are_parsed_into_typed_fields():
    parsed = settings.from_env({
        "WANLINK_STREAMS": "8", "WANLINK_UNIX": "0", "WANLINK_COMPRESS": "yes", "WANLINK_SECRET": "s",
        "WANLINK_CHUNK_SIZE": str(1 << 20), "WANLINK_PIECE_BYTES": "65536", "WANLINK_ADDR": " ",
        "WANLINK_CHUNK_ORDER": " FCFS", "WANLINK_CONGESTION": " Cubic",
    })
    assert parsed.congestion == "cubic"
    assert parsed.chunk_order == "fcfs"
    assert parsed.streams == 8 and parsed.unix is False and parsed.compress is True
    assert parsed.secret == "s" and parsed.chunk_size == 1 << 20 and parsed.piece_bytes == 65536
    assert parsed.addr is None


def test_streams_auto_is_kept_apart_from_unset():
    assert settings.from_env({"WANLINK_STREAMS": "AUTO"}).streams == "auto"
    assert settings.from_env({"WANLINK_STREAMS": ""}).streams is None


@pytest.mark.parametrize("name, value", [
    ("WANLINK_STREAMS", "many"), ("WANLINK_STREAMS", "0"), ("WANLINK_STREAMS", "65"),
    ("WANLINK_CHUNK_SIZE", "1024"), ("WANLINK_UNIX", "maybe"), ("WANLINK_PIECE_BYTES", "0"),
    ("WANLINK_DIRECT_MAX_BYTES", "-1"), ("WANLINK_GC_FREEZE", "2"),
    ("WANLINK_CHUNK_ORDER", "random"), ("WANLINK_CONGESTION", "bbr; rm"), ("WANLINK_CONGESTION", "x" * 16),
])
def test_a_bad_value_names_the_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        settings.from_env({name: value})


def test_every_field_has_one_variable():
    fields = [f.name for f in settings.dataclasses.fields(settings.Settings)]
    assert sorted(v.field for v in settings.VARIABLES) == sorted(fields)


def test_documentation_table_matches_the_code():
    assert settings.markdown_table() in DOCS.read_text()


BUILD_TIME_VARIABLES = {"WANLINK_NO_EXT"}  # read by setup.py alone; documented below the table


def _names_in(path: Path) -> tuple[set[str], set[str]]:
    """WANLINK_* names inside a Python file's string literals (os.environ keys, messages, docs), and
    those that are Python identifiers there (constants such as State.WANLINK_ACCEPT, not variables)."""
    with tokenize.open(path) as handle:
        tokens = list(tokenize.generate_tokens(handle.readline))
    strings = [t.string for t in tokens if t.type in (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1))]
    identifiers = {t.string for t in tokens if t.type == tokenize.NAME and t.string.startswith("WANLINK_")}
    return {name for text in strings for name in re.findall(r"\bWANLINK_[A-Z0-9_]+\b", text)}, identifiers


def test_every_variable_the_code_names_is_in_the_table():
    root = DOCS.parents[1]
    sources = [root / "setup.py", root / "dev.py", *root.glob("wanlink/**/*.py"), *root.glob("bench/**/*.py"),
               *root.glob("examples/*.py")]
    named, identifiers = {}, set()
    for path in sources:
        in_strings, in_code = _names_in(path)
        named.update(dict.fromkeys(in_strings, path))
        identifiers |= in_code
    named = {name: path for name, path in named.items() if name not in identifiers}
    documented = {v.name for v in settings.VARIABLES} | BUILD_TIME_VARIABLES
    missing = {name: str(path.relative_to(root)) for name, path in named.items() if name not in documented}
    assert not missing, f"WANLINK_* variables named in the code but not in wanlink.settings.VARIABLES: {missing}"
    assert "WANLINK_SECRET" in named  # the scan finds what it should
    page = DOCS.read_text()
    assert all(name in page for name in BUILD_TIME_VARIABLES)


def test_site_is_any_name_and_a_bad_one_names_the_variable():
    assert settings.from_env({"WANLINK_SITE": " gcp-europe-west4 "}).site == "gcp-europe-west4"
    assert settings.from_env({"WANLINK_SITE": ""}).site is None
    with pytest.raises(ConfigError, match="WANLINK_SITE"):
        settings.from_env({"WANLINK_SITE": "x" * 200})
