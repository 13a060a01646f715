"""wanlink-iperf's command line: iperf3's options (TCP tests), checked into one :class:`Options`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from wanlink.iperf import protocol as proto
from wanlink.iperf.output import PROG, VERSION

RATE_FORMATS = "kmgtKMGT"  # iperf3's -f: Kbits, Mbits, Gbits, Tbits; upper case: KBytes ... TBytes


def parse_size(text: str) -> int:
    """iperf3 sizes: a number with an optional K/M/G/T suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    raw = text.strip()
    mult = units.get(raw[-1:].lower(), 1) if raw else 1
    number = raw[:-1] if mult != 1 else raw
    try:
        value = float(number) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 128K, 10M, 1G)") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


class _VersionReport(argparse.Action):
    """``-v/--version``: the program's version, then ``python -m wanlink info``'s report, for bug reports."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from wanlink.about import report
        print(f"{VERSION}\n{report()}", flush=True)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="iperf3's command line and wire protocol, with "
                                "wanlink Links as the data path.",
                                epilog="The shared secret for wanlink links is read from WANLINK_SECRET "
                                       "(unset: unauthenticated).")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("-s", "--server", action="store_true", help="run in server mode")
    mode.add_argument("-c", "--client", metavar="HOST", help="run in client mode, connecting to HOST")
    p.add_argument("-p", "--port", type=int, default=proto.DEFAULT_PORT, help="server port (default 5201)")
    p.add_argument("-B", "--bind", metavar="HOST", default=None, help="bind to this local address")
    p.add_argument("-P", "--parallel", type=_positive_int, default=None,
                   help="number of parallel streams (default: probed against a wanlink-iperf server)")
    p.add_argument("-t", "--time", type=float, default=None, help="seconds to transmit (default 10)")
    p.add_argument("-n", "--bytes", type=parse_size, default=None, help="bytes to transmit instead of -t")
    p.add_argument("-k", "--blockcount", type=parse_size, default=None, help="blocks (-l) to transmit")
    p.add_argument("-l", "--length", type=parse_size, default=proto.DEFAULT_BLOCKSIZE,
                   help="length of a write/read buffer (default 128K; plain iperf3 streams)")
    p.add_argument("-i", "--interval", type=float, default=1.0, help="seconds between reports (0 = none)")
    p.add_argument("-J", "--json", action="store_true", help="output JSON")
    p.add_argument("-f", "--format", choices=RATE_FORMATS, metavar="[kmgtKMGT]", default=None,
                   help="bitrate unit: Kbits, Mbits, Gbits, Tbits (upper case: KBytes ... TBytes); default adaptive")
    p.add_argument("-R", "--reverse", action="store_true", help="reverse mode: the server sends")
    p.add_argument("--bidir", action="store_true", help="both directions at once")
    p.add_argument("-1", "--one-off", action="store_true", help="server: handle one client, then exit")
    p.add_argument("-C", "--congestion", metavar="ALGO", default=None,
                   help="TCP congestion control (default: bbr when the kernel offers it)")
    p.add_argument("-w", "--window", type=parse_size, default=None,
                   help="socket buffer size (SO_SNDBUF/SO_RCVBUF); default: kernel autotuning")
    p.add_argument("--connect-timeout", type=float, default=10000.0, metavar="MS",
                   help="timeout for connecting to the server, in ms (default 10000)")
    p.add_argument("--max-streams", type=_positive_int, default=64, help="upper bound of the stream probe")
    p.add_argument("--no-wanlink", action="store_true", help="client: plain iperf3 TCP streams only")
    p.add_argument("-u", "--udp", action="store_true", help="refused: wanlink-iperf runs TCP tests only")
    p.add_argument("-b", "--bitrate", metavar="RATE", default=None,
                   help="refused unless 0: wanlink-iperf does not pace (iperf3's TCP default, unlimited)")
    p.add_argument("-v", "--version", action=_VersionReport, help="version, kernels, event loop and TCP facts")
    return p


@dataclass
class Options:
    """The checked command line (sizes in bytes, times in seconds)."""

    server: bool
    host: str | None
    port: int
    bind: str | None
    parallel: int | None
    time: float
    bytes: int
    blockcount: int
    length: int
    interval: float
    json: bool
    rate_format: str  # iperf3's -f letter, "a" (adaptive bits) by default
    reverse: bool
    bidir: bool
    one_off: bool
    congestion: str | None
    window: int | None
    connect_timeout: float
    max_streams: int
    wanlink: bool


def parse_args(argv=None) -> Options:
    """Parse and check the command line (argparse exits with status 2 on errors)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.udp:
        parser.error("-u: UDP tests are not supported: wanlink carries TCP streams only "
                     "(stock iperf3 -u measures UDP)")
    if a.bitrate is not None and a.bitrate.strip() not in ("0", "0/0"):
        parser.error(f"-b {a.bitrate}: pacing to a target bitrate is not supported: wanlink-iperf sends as fast "
                     "as TCP allows (iperf3's TCP default, -b 0); limit the amount with -n or -k instead")
    if not 0 <= a.port <= 65535 or (a.client and a.port == 0):
        parser.error(f"port must be in [1, 65535] (0 = any free port, server only), got {a.port}")
    if a.server and (a.reverse or a.bidir or a.parallel or a.bytes or a.blockcount or a.time is not None):
        parser.error("-R, --bidir, -P, -t, -n and -k are client options")
    if a.client and a.one_off:
        parser.error("-1 is a server option")
    if a.reverse and a.bidir:
        parser.error("-R and --bidir exclude each other")
    if sum(x is not None for x in (a.time, a.bytes, a.blockcount)) > 1:
        parser.error("give at most one of -t, -n and -k")
    duration = 10.0 if a.time is None else a.time
    if not 0 < duration <= proto.MAX_TIME and not (a.bytes or a.blockcount):
        parser.error(f"-t must be in (0, {proto.MAX_TIME}] seconds")
    if a.interval != 0 and not 0.1 <= a.interval <= 60:
        parser.error("-i must be 0 or in [0.1, 60] seconds")
    if a.parallel is not None and a.parallel > proto.MAX_STREAMS:
        parser.error(f"-P must be at most {proto.MAX_STREAMS}")
    if not 1 <= a.length <= proto.MAX_BLOCKSIZE:
        parser.error(f"-l must be in [1, {proto.MAX_BLOCKSIZE}]")
    if a.window is not None and not 1 <= a.window <= proto.MAX_WINDOW:
        parser.error(f"-w must be in [1, {proto.MAX_WINDOW}]")
    if a.connect_timeout <= 0:
        parser.error("--connect-timeout must be positive")
    return Options(server=a.server, host=a.client, port=a.port, bind=a.bind, parallel=a.parallel,
                   time=0.0 if (a.bytes or a.blockcount) else duration, bytes=a.bytes or 0,
                   blockcount=a.blockcount or 0, length=a.length, interval=a.interval, json=a.json,
                   rate_format=a.format or "a",
                   reverse=a.reverse, bidir=a.bidir, one_off=a.one_off, congestion=a.congestion, window=a.window,
                   connect_timeout=a.connect_timeout / 1000.0, max_streams=min(a.max_streams, 64),
                   wanlink=not a.no_wanlink)
