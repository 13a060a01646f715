"""iperf3-style reports, pure: the per-interval table (per stream and SUM) and the ``-J`` document.

Text lines follow iperf3's formats (``iperf_locale.c``) and unit rules (``units.c``: bytes in
1024 steps, bits in 1000 steps, always four significant places); JSON uses iperf3's keys so tools
that read ``iperf3 -J`` read ours.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SEPARATOR = "- - - - - - - - - - - - - - - - - - - - - - - - -"
_BYTE_LABELS = ("Byte", "KByte", "MByte", "GByte", "TByte")
_BIT_LABELS = ("bit", "Kbit", "Mbit", "Gbit", "Tbit")


def _four_places(value: float) -> str:
    if value < 9.995:
        return f"{value:4.2f}"
    if value < 99.95:
        return f"{value:4.1f}"
    return f"{value:4.0f}"


def _adaptive(value: float, base: float, labels) -> str:
    conv = 0
    while value >= base and conv < len(labels) - 1:
        value /= base
        conv += 1
    return f"{_four_places(value)} {labels[conv]}"


def format_bytes(nbytes: float) -> str:
    """``1.25 GBytes``, as iperf3 prints a transfer (1024 steps)."""
    return _adaptive(float(nbytes), 1024.0, _BYTE_LABELS) + "s"


def format_bits(bits_per_second: float, unit: str = "a") -> str:
    """``10.7 Gbits/sec``, as iperf3 prints a bitrate for ``-f unit``.

    ``a`` (the default) picks the unit (1000 steps); ``k``/``m``/``g``/``t`` fix Kbits ... Tbits,
    ``K``/``M``/``G``/``T`` fix KBytes ... TBytes (1024 steps), as iperf3's ``unit_snprintf``.
    """
    if unit == "a":
        return _adaptive(float(bits_per_second), 1000.0, _BIT_LABELS) + "s/sec"
    power = "kmgt".index(unit.lower()) + 1
    if unit.islower():
        value, label = bits_per_second / 1000.0 ** power, _BIT_LABELS[power]
    else:
        value, label = bits_per_second / 8.0 / 1024.0 ** power, _BYTE_LABELS[power]
    return f"{_four_places(value)} {label}s/sec"


@dataclass
class StreamSample:
    """One stream over one interval (or over the whole test)."""

    id: int  # what iperf3 shows in "[ ID]": the socket's descriptor
    start: float
    end: float
    bytes: int
    sender: bool
    retransmits: int | None = None  # sender side, from TCP_INFO
    snd_cwnd: int | None = None  # bytes
    rtt_us: int | None = None
    rttvar_us: int | None = None
    pmtu: int | None = None
    snd_wnd: int | None = None  # bytes; Linux 5.4 and later

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def bits_per_second(self) -> float:
        return self.bytes * 8.0 / self.seconds if self.seconds > 0 else 0.0

    def to_json(self, *, socket: bool = True) -> dict:
        out = {"socket": self.id} if socket else {}
        out.update(start=self.start, end=self.end, seconds=self.seconds, bytes=self.bytes,
                   bits_per_second=self.bits_per_second)
        if self.sender and self.retransmits is not None:
            out["retransmits"] = self.retransmits
            for key, value in (("snd_cwnd", self.snd_cwnd), ("snd_wnd", self.snd_wnd), ("rtt", self.rtt_us),
                               ("rttvar", self.rttvar_us), ("pmtu", self.pmtu)):
                if value is not None:
                    out[key] = value
        out.update(omitted=False, sender=self.sender)
        return out


def sum_samples(samples: list[StreamSample], sender: bool) -> StreamSample:
    """The SUM row of samples (bytes add up; the interval is the widest one)."""
    retrans = [s.retransmits for s in samples if s.retransmits is not None]
    return StreamSample(id=-1, start=min((s.start for s in samples), default=0.0),
                        end=max((s.end for s in samples), default=0.0), bytes=sum(s.bytes for s in samples),
                        sender=sender, retransmits=sum(retrans) if retrans else None)


def _line(tag: str, role: str, s: StreamSample, *, retr: bool, cwnd: bool, suffix: str, unit: str) -> str:
    rate = format_bits(s.bits_per_second, unit)
    head = f"[{tag}]{role} {s.start:6.2f}-{s.end:<6.2f} sec  {format_bytes(s.bytes)}  {rate}"
    if retr and s.sender and s.retransmits is not None:
        if cwnd and s.snd_cwnd is not None:
            return f"{head}  {s.retransmits:3d}   {format_bytes(s.snd_cwnd)}       {suffix}".rstrip()
        return f"{head}  {s.retransmits:3d}             {suffix}".rstrip()
    return f"{head}                  {suffix}".rstrip()


def header(*, retr: bool, cwnd: bool, bidir: bool) -> str:
    role = "[Role]" if bidir else ""
    cols = "  Retr  Cwnd" if retr and cwnd else ("  Retr" if retr else "")
    return f"[ ID]{role} Interval           Transfer     Bitrate       {cols}".rstrip()


def stream_line(s: StreamSample, *, role: str = "", retr: bool = False, cwnd: bool = False, suffix: str = "",
                unit: str = "a") -> str:
    """One stream's row; ``unit`` is iperf3's ``-f`` letter for the bitrate column."""
    return _line(f"{s.id:3d}", role, s, retr=retr, cwnd=cwnd, suffix=suffix, unit=unit)


def sum_line(s: StreamSample, *, role: str = "", retr: bool = False, suffix: str = "", unit: str = "a") -> str:
    return _line("SUM", role, s, retr=retr, cwnd=False, suffix=suffix, unit=unit)


def interval_lines(samples: list[StreamSample], *, retr: bool, roles: dict[bool, str] | None = None,
                   unit: str = "a") -> list[str]:
    """Table rows for one interval: each stream, then a SUM row per direction when there are several streams."""
    roles = roles or {}
    lines = [stream_line(s, role=roles.get(s.sender, ""), retr=retr, cwnd=retr, unit=unit) for s in samples]
    for sender in (True, False):
        group = [s for s in samples if s.sender == sender]
        if len(group) > 1 or (roles and group):
            lines.append(sum_line(sum_samples(group, sender), role=roles.get(sender, ""), retr=retr, unit=unit))
    return lines


def interval_json(samples: list[StreamSample], *, bidir: bool) -> dict:
    """One element of iperf3's ``intervals`` list."""
    out: dict = {"streams": [s.to_json() for s in samples]}
    senders = [s for s in samples if s.sender]
    receivers = [s for s in samples if not s.sender]
    if bidir:
        out["sum"] = _sum_json(senders, True)
        out["sum_bidir_reverse"] = _sum_json(receivers, False)
    else:
        out["sum"] = _sum_json(samples, bool(senders))
    return out


def _sum_json(samples: list[StreamSample], sender: bool) -> dict:
    total = sum_samples(samples, sender)
    out = total.to_json(socket=False)
    if not sender:
        out.pop("retransmits", None)
    return out


@dataclass
class SenderTcpStats:
    """One sending stream's TCP_INFO over a test, as iperf3 sums it up in ``end`` (cwnd/window bytes, RTT µs).

    Every sample (each interval, and the end of the test) counts. Zero where nothing was sampled
    (a stream the peer sent: the results exchange does not carry these) and ``max_snd_wnd`` zero
    where the kernel has no ``snd_wnd`` (before Linux 5.4), as iperf3 writes them.
    """

    max_snd_cwnd: int = 0
    max_snd_wnd: int = 0
    max_rtt: int = 0
    min_rtt: int = 0
    rtt_sum: int = 0
    rtt_count: int = 0

    def add(self, *, snd_cwnd: int, snd_wnd: int | None, rtt: int) -> None:
        self.max_snd_cwnd = max(self.max_snd_cwnd, snd_cwnd)
        self.max_snd_wnd = max(self.max_snd_wnd, snd_wnd or 0)
        self.max_rtt = max(self.max_rtt, rtt)
        self.min_rtt = rtt if self.rtt_count == 0 else min(self.min_rtt, rtt)
        self.rtt_sum += rtt
        self.rtt_count += 1

    def to_json(self) -> dict:
        mean = self.rtt_sum // self.rtt_count if self.rtt_count else 0
        return {"max_snd_cwnd": self.max_snd_cwnd, "max_snd_wnd": self.max_snd_wnd, "max_rtt": self.max_rtt,
                "min_rtt": self.min_rtt, "mean_rtt": mean}


@dataclass
class StreamTotals:
    """Both ends of one stream over the whole test (one side measured here, one reported by the peer)."""

    sent: StreamSample
    received: StreamSample
    local_sender: bool = True  # iperf3's "sender" flag in ``end``: this side sent the stream
    sender_tcp: SenderTcpStats = field(default_factory=SenderTcpStats)  # filled when this side sent


def end_json(totals: list[StreamTotals], *, local_sender_reverse: list[StreamTotals] | None = None,
             cpu: dict, sender_congestion: str | None, receiver_congestion: str | None) -> dict:
    """iperf3's ``end`` object; ``local_sender_reverse`` carries the reverse direction of a bidir test."""

    def summarize(items: list[StreamTotals]) -> tuple[dict, dict]:
        sent = sum_samples([t.sent for t in items], True)
        received = sum_samples([t.received for t in items], True)
        sent_j = sent.to_json(socket=False)
        sent_j.pop("omitted", None)
        recv_j = received.to_json(socket=False)
        for key in ("omitted", "retransmits"):
            recv_j.pop(key, None)
        local_sender = items[0].local_sender if items else True
        sent_j["sender"] = recv_j["sender"] = local_sender
        return sent_j, recv_j

    def per_stream(t: StreamTotals) -> dict:
        sender = t.sent.to_json()
        receiver = t.received.to_json()
        if "retransmits" in sender:  # iperf3 adds the TCP_INFO summary where the sender reports retransmits
            sender.update(t.sender_tcp.to_json())
        for d in (sender, receiver):
            d.pop("omitted", None)
            d.pop("sender")
            d["sender"] = t.local_sender
        receiver.pop("retransmits", None)
        return {"sender": sender, "receiver": receiver}

    out: dict = {"streams": [per_stream(t) for t in totals + (local_sender_reverse or [])]}
    out["sum_sent"], out["sum_received"] = summarize(totals)
    if local_sender_reverse is not None:
        out["sum_sent_bidir_reverse"], out["sum_received_bidir_reverse"] = summarize(local_sender_reverse)
    out["cpu_utilization_percent"] = cpu
    if sender_congestion:
        out["sender_tcp_congestion"] = sender_congestion
    if receiver_congestion:
        out["receiver_tcp_congestion"] = receiver_congestion
    return out


def summary_lines(totals: list[StreamTotals], *, retr: bool, role: str = "", unit: str = "a") -> list[str]:
    """The closing table: per stream a sender and a receiver line, then the SUM lines."""
    lines = []
    for t in totals:
        lines.append(stream_line(t.sent, role=role, retr=retr, suffix="sender", unit=unit))
        lines.append(stream_line(t.received, role=role, retr=retr, suffix="receiver", unit=unit))
    if len(totals) > 1 or role:
        sent = sum_samples([t.sent for t in totals], True)
        received = sum_samples([t.received for t in totals], False)
        lines.append(sum_line(sent, role=role, retr=retr, suffix="sender", unit=unit))
        lines.append(sum_line(received, role=role, retr=False, suffix="receiver", unit=unit))
    return lines
