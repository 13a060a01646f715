"""wanlink logs like a library: a NullHandler on its logger tree, and messages without a prefix of their own."""
import logging
import re
from pathlib import Path

import wanlink

PACKAGE = Path(wanlink.__file__).parent
LOG_CALL_WITH_PREFIX = re.compile(r"\b(log|logger)\.(debug|info|warning|error|exception|critical)\(\s*f?[\"']wanlink")


def test_package_logger_has_a_null_handler():
    handlers = logging.getLogger("wanlink").handlers
    assert any(isinstance(handler, logging.NullHandler) for handler in handlers)


def test_log_messages_carry_no_wanlink_prefix():
    """The logger's name says where a record came from; formatters (wanlink-iperf's too) add one prefix."""
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{number}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1) if LOG_CALL_WITH_PREFIX.search(line)]
    assert not offenders, offenders


def test_loggers_live_under_the_package_logger():
    names = {match for path in PACKAGE.rglob("*.py")
             for match in re.findall(r"getLogger\(\s*[\"']([^\"']+)[\"']", path.read_text())}
    assert all(name == "wanlink" or name.startswith("wanlink.") for name in names), names
