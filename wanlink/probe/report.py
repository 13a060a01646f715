"""iperf3-style reports, pure: the per-interval table (per stream and SUM) and the ``-J`` document.

Text lines follow iperf3's formats (``iperf_locale.c``) and unit rules (``units.c``: bytes in
1024 steps, bits in 1000 steps, always four significant places); JSON uses iperf3's keys so tools
that read ``iperf3 -J`` read ours.
"""
from __future__ import annotations

from dataclasses import dataclass

SEPARATOR = "- - - - - - - - - - - - - - - - - - - - - - - - -"
_BYTE_LABELS = ("Byte", "KByte", "MByte", "GByte", "TByte")
_BIT_LABELS = ("bit", "Kbit", "Mbit", "Gbit", "Tbit")


def _adaptive(value: float, base: float, labels) -> str:
    conv = 0
    while value >= base and conv < len(labels) - 1:
        value /= base
        conv += 1
    if value < 9.995:
        text = f"{value:4.2f}"
    elif value < 99.95:
        text = f"{value:4.1f}"
    else:
        text = f"{value:4.0f}"
    return f"{text} {labels[conv]}"


def format_bytes(nbytes: float) -> str:
    """``1.25 GBytes``, as iperf3 prints a transfer (1024 steps)."""
    return _adaptive(float(nbytes), 1024.0, _BYTE_LABELS) + "s"


def format_bits(bits_per_second: float) -> str:
    """``10.7 Gbits/sec``, as iperf3 prints a bitrate (1000 steps)."""
    return _adaptive(float(bits_per_second), 1000.0, _BIT_LABELS) + "s/sec"


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
            for key, value in (("snd_cwnd", self.snd_cwnd), ("rtt", self.rtt_us), ("rttvar", self.rttvar_us),
                               ("pmtu", self.pmtu)):
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


def _line(tag: str, role: str, s: StreamSample, *, retr: bool, cwnd: bool, suffix: str = "") -> str:
    head = f"[{tag}]{role} {s.start:6.2f}-{s.end:<6.2f} sec  {format_bytes(s.bytes)}  {format_bits(s.bits_per_second)}"
    if retr and s.sender and s.retransmits is not None:
        if cwnd and s.snd_cwnd is not None:
            return f"{head}  {s.retransmits:3d}   {format_bytes(s.snd_cwnd)}       {suffix}".rstrip()
        return f"{head}  {s.retransmits:3d}             {suffix}".rstrip()
    return f"{head}                  {suffix}".rstrip()


def header(*, retr: bool, cwnd: bool, bidir: bool) -> str:
    role = "[Role]" if bidir else ""
    cols = "  Retr  Cwnd" if retr and cwnd else ("  Retr" if retr else "")
    return f"[ ID]{role} Interval           Transfer     Bitrate       {cols}".rstrip()


def stream_line(s: StreamSample, *, role: str = "", retr: bool = False, cwnd: bool = False, suffix: str = "") -> str:
    return _line(f"{s.id:3d}", role, s, retr=retr, cwnd=cwnd, suffix=suffix)


def sum_line(s: StreamSample, *, role: str = "", retr: bool = False, suffix: str = "") -> str:
    return _line("SUM", role, s, retr=retr, cwnd=False, suffix=suffix)


def interval_lines(samples: list[StreamSample], *, retr: bool, roles: dict[bool, str] | None = None) -> list[str]:
    """Table rows for one interval: each stream, then a SUM row per direction when there are several streams."""
    roles = roles or {}
    lines = [stream_line(s, role=roles.get(s.sender, ""), retr=retr, cwnd=retr) for s in samples]
    for sender in (True, False):
        group = [s for s in samples if s.sender == sender]
        if len(group) > 1 or (roles and group):
            lines.append(sum_line(sum_samples(group, sender), role=roles.get(sender, ""), retr=retr))
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
class StreamTotals:
    """Both ends of one stream over the whole test (one side measured here, one reported by the peer)."""

    sent: StreamSample
    received: StreamSample
    local_sender: bool = True  # iperf3's "sender" flag in ``end``: this side sent the stream


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
        for d in (sender, receiver):
            d.pop("omitted", None)
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


def summary_lines(totals: list[StreamTotals], *, retr: bool, role: str = "") -> list[str]:
    """The closing table: per stream a sender and a receiver line, then the SUM lines."""
    lines = []
    for t in totals:
        lines.append(stream_line(t.sent, role=role, retr=retr, suffix="sender"))
        lines.append(stream_line(t.received, role=role, retr=retr, suffix="receiver"))
    if len(totals) > 1 or role:
        sent = sum_samples([t.sent for t in totals], True)
        received = sum_samples([t.received for t in totals], False)
        lines.append(sum_line(sent, role=role, retr=retr, suffix="sender"))
        lines.append(sum_line(received, role=role, retr=False, suffix="receiver"))
    return lines
