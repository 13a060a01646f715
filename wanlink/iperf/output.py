"""Where wanlink-iperf writes: the report to stdout (text, or one JSON document with ``-J``), messages to stderr."""
from __future__ import annotations

import json
import logging
import sys

import wanlink
from wanlink.errors import WanlinkError

PROG = "wanlink-iperf"
VERSION = f"wanlink-iperf {wanlink.__version__} (iperf3 protocol)"


class CliError(WanlinkError, RuntimeError):
    """A failure to report to the user as ``wanlink-iperf: error - <message>`` (exit status 1)."""


class Output:
    """Text lines to stdout, or one JSON document per test with ``-J``; messages to stderr."""

    def __init__(self, json_mode: bool, stdout=None, stderr=None):
        self.json_mode = json_mode
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr

    def line(self, text: str = "") -> None:
        if not self.json_mode:
            print(text, file=self.stdout, flush=True)

    def warn(self, text: str) -> None:
        print(f"{PROG}: warning - {text}", file=self.stderr, flush=True)

    def error(self, text: str) -> None:
        print(f"{PROG}: error - {text}", file=self.stderr, flush=True)

    def document(self, doc: dict) -> None:
        print(json.dumps(doc, indent=2), file=self.stdout, flush=True)


def secret_bytes(secret: str | None, out: Output) -> bytes:
    """WANLINK_SECRET (from the settings) as bytes; unset or empty says once that links run unauthenticated."""
    if not secret:
        out.warn("WANLINK_SECRET is not set: wanlink links run unauthenticated (empty secret)")
        return b""
    return secret.encode()


class _QuietUnauthenticated(logging.Filter):
    """The transport warns once per link about an empty secret; the CLI says it once."""

    def filter(self, record):
        return "without authentication" not in record.getMessage()


def route_transport_logging(out: Output):
    """Route the transport's warnings to our stderr for this run; returns the undo function."""
    logger = logging.getLogger("wanlink")
    handler = logging.StreamHandler(out.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    handler.addFilter(_QuietUnauthenticated())
    saved = logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING)

    def undo():
        logger.removeHandler(handler)
        logger.propagate, logger.level = saved
    return undo
