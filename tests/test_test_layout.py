"""Test helpers are imported one way: from tests.support (pytest puts the repository root on sys.path)."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FORBIDDEN = re.compile(r"^\s*(from\s+\S*conftest\s+import|import\s+\S*conftest|sys\.path\.(insert|append))", re.M)


def test_no_test_imports_a_conftest_or_edits_sys_path():
    offenders = [str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py") if FORBIDDEN.search(path.read_text())]
    assert not offenders, f"import helpers from tests.support instead: {offenders}"
