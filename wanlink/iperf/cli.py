"""The ``wanlink-iperf`` command: parse the command line, read the settings, run a client or a server."""
from __future__ import annotations

import asyncio
import signal
import sys
import threading

from wanlink.errors import ConfigError, PeerLost, ProtocolError
from wanlink.iperf.client import Client
from wanlink.iperf.options import Options, parse_args
from wanlink.iperf.output import PROG, CliError, Output, route_transport_logging
from wanlink.iperf.server import IperfServer
from wanlink.settings import from_env


async def run(argv=None, *, stdout=None, stderr=None, on_listening=None, stop: asyncio.Event | None = None) -> int:
    """Run wanlink-iperf inside a running event loop; returns the exit status."""
    opts = parse_args(argv)
    out = Output(opts.json, stdout, stderr)
    undo_logging = route_transport_logging(out)
    loop = asyncio.get_running_loop()
    installed = []
    own_signals = stop is None and threading.current_thread() is threading.main_thread()  # else the caller's job
    stop = stop if stop is not None else asyncio.Event()
    if own_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
    try:
        settings = from_env()  # WANLINK_SECRET, WANLINK_STREAMS, WANLINK_CHUNK_SIZE
        if opts.server:
            return await IperfServer(opts, out, stop, settings, on_listening).run()
        client = Client(opts, out, stop, settings)
        try:
            return await client.run()
        except (CliError, ConfigError) as exc:
            return _fail(out, opts, client.doc, str(exc))
        except (ProtocolError, PeerLost) as exc:
            return _fail(out, opts, client.doc, f"protocol error talking to {opts.host}: {exc}")
    except (CliError, ConfigError) as exc:
        return _fail(out, opts, {}, str(exc))
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        undo_logging()


def _fail(out: Output, opts: Options, doc: dict, message: str) -> int:
    out.error(message)
    if opts.json and not opts.server:
        out.document({**doc, "error": message})
    return 1


def main(argv=None) -> int:
    """Console entry point: ``wanlink-iperf``."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a Linux dependency
        uvloop = None
    try:
        if uvloop is not None:
            return uvloop.run(run(argv))
        return asyncio.run(run(argv))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
