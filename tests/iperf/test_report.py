"""iperf3-style report formatting: units, table lines, JSON sums."""
import pytest

from wanlink.iperf.report import (
    SEPARATOR, SenderTcpStats, StreamSample, StreamTotals, end_json, format_bits, format_bytes, header, interval_json,
    interval_lines, summary_lines,
)


@pytest.mark.parametrize("value,text", [
    (0, "0.00 Bytes"), (1023, "1023 Bytes"), (1024, "1.00 KBytes"), (393216, " 384 KBytes"),
    (1342177280, "1.25 GBytes"), (5.5 * 2**20, "5.50 MBytes"), (99.96 * 2**20, " 100 MBytes"),
])
def test_bytes_use_1024_steps_and_four_places(value, text):
    assert format_bytes(value) == text


@pytest.mark.parametrize("value,text", [
    (10.7e9, "10.7 Gbits/sec"), (7.40e9, "7.40 Gbits/sec"), (469e6, " 469 Mbits/sec"), (0, "0.00 bits/sec"),
    (999.4, " 999 bits/sec"),
])
def test_bits_use_1000_steps(value, text):
    assert format_bits(value) == text


def sample(sid, nbytes, sender=True, retr=None, cwnd=None, start=0.0, end=1.0):
    return StreamSample(id=sid, start=start, end=end, bytes=nbytes, sender=sender, retransmits=retr, snd_cwnd=cwnd)


def test_interval_table_matches_iperf3_layout():
    rows = interval_lines([sample(5, 1342177280, retr=14, cwnd=1436549), sample(7, 1288490188, retr=7, cwnd=1436549)],
                          retr=True)
    assert rows[0] == "[  5]   0.00-1.00   sec  1.25 GBytes  10.7 Gbits/sec   14   1.37 MBytes"
    assert rows[2] == "[SUM]   0.00-1.00   sec  2.45 GBytes  21.0 Gbits/sec   21"
    assert header(retr=True, cwnd=True, bidir=False) == \
        "[ ID] Interval           Transfer     Bitrate         Retr  Cwnd"
    assert header(retr=False, cwnd=False, bidir=True) == "[ ID][Role] Interval           Transfer     Bitrate"
    assert SEPARATOR.startswith("- - -")


def test_single_stream_has_no_sum_row_unless_bidir():
    assert len(interval_lines([sample(5, 100)], retr=False)) == 1
    rows = interval_lines([sample(5, 100), sample(6, 50, sender=False)], retr=False,
                          roles={True: "[TX-C]", False: "[RX-C]"})
    assert [r[:11] for r in rows] == ["[  5][TX-C]", "[  6][RX-C]", "[SUM][TX-C]", "[SUM][RX-C]"]


def test_interval_json_sums():
    doc = interval_json([sample(5, 1000, retr=1), sample(7, 3000, retr=2)], bidir=False)
    assert doc["sum"]["bytes"] == 4000 and doc["sum"]["retransmits"] == 3
    assert doc["sum"]["bits_per_second"] == pytest.approx(32000)
    assert [s["socket"] for s in doc["streams"]] == [5, 7]
    bidir = interval_json([sample(5, 1000), sample(7, 3000, sender=False)], bidir=True)
    assert bidir["sum"]["bytes"] == 1000 and bidir["sum_bidir_reverse"]["bytes"] == 3000


def test_end_json_has_iperf3_sums():
    totals = [StreamTotals(sent=sample(5, 2000, retr=3, end=2.0), received=sample(5, 1900, sender=False, end=2.0)),
              StreamTotals(sent=sample(7, 1000, retr=0, end=2.0), received=sample(7, 1000, sender=False, end=2.0))]
    end = end_json(totals, cpu={"host_total": 1.0}, sender_congestion="bbr", receiver_congestion="cubic")
    assert end["sum_sent"]["bytes"] == 3000 and end["sum_sent"]["retransmits"] == 3
    assert end["sum_received"]["bytes"] == 2900 and "retransmits" not in end["sum_received"]
    assert end["sum_received"]["bits_per_second"] == pytest.approx(2900 * 8 / 2.0)
    assert end["sender_tcp_congestion"] == "bbr" and end["receiver_tcp_congestion"] == "cubic"
    assert set(end["streams"][0]) == {"sender", "receiver"}
    lines = summary_lines(totals, retr=True)
    assert lines[0].endswith("sender") and lines[1].endswith("receiver") and lines[-1].startswith("[SUM]")
    bidir = end_json(totals[:1], local_sender_reverse=totals[1:], cpu={}, sender_congestion=None,
                     receiver_congestion=None)
    assert bidir["sum_sent_bidir_reverse"]["bytes"] == 1000


@pytest.mark.parametrize("unit,value,text", [
    ("k", 50.3e6, "50300 Kbits/sec"), ("m", 50.3e6, "50.3 Mbits/sec"), ("g", 50.3e6, "0.05 Gbits/sec"),
    ("t", 2.5e12, "2.50 Tbits/sec"), ("K", 6 * 2**20 * 8, "6144 KBytes/sec"), ("M", 6 * 2**20 * 8, "6.00 MBytes/sec"),
    ("G", 3 * 2**30 * 8, "3.00 GBytes/sec"), ("T", 2**40 * 8, "1.00 TBytes/sec"), ("a", 50.3e6, "50.3 Mbits/sec"),
])
def test_rate_format_fixes_the_unit_as_iperf3_f(unit, value, text):
    # "6144 KBytes/sec" and "50.3 Mbits/sec" are what iperf3 3.12 -f K / -f m print for 6 MBytes in 1 s
    assert format_bits(value, unit) == text


def test_rate_format_applies_to_the_bitrate_column_only():
    row = interval_lines([sample(5, 6 * 2**20, retr=0, cwnd=1 << 20)], retr=True, unit="K")[0]
    assert row == "[  5]   0.00-1.00   sec  6.00 MBytes  6144 KBytes/sec    0   1.00 MBytes"
    totals = [StreamTotals(sent=sample(5, 2**20, retr=0), received=sample(5, 2**20, sender=False))]
    assert all("Mbits/sec" not in line and "KBytes/sec" in line for line in summary_lines(totals, retr=True, unit="K"))


def test_sender_tcp_stats_sum_up_every_sample():
    stats = SenderTcpStats()
    assert stats.to_json() == {"max_snd_cwnd": 0, "max_snd_wnd": 0, "max_rtt": 0, "min_rtt": 0, "mean_rtt": 0}
    stats.add(snd_cwnd=100, snd_wnd=None, rtt=300)
    stats.add(snd_cwnd=400, snd_wnd=5000, rtt=100)
    stats.add(snd_cwnd=200, snd_wnd=7000, rtt=201)
    assert stats.to_json() == {"max_snd_cwnd": 400, "max_snd_wnd": 7000, "max_rtt": 300, "min_rtt": 100,
                               "mean_rtt": 200}


def test_end_json_sender_carries_the_tcp_summary_where_retransmits_are_known():
    measured = SenderTcpStats()
    measured.add(snd_cwnd=64000, snd_wnd=128000, rtt=40000)
    local = StreamTotals(sent=sample(5, 2000, retr=3), received=sample(5, 2000, sender=False), sender_tcp=measured)
    remote = StreamTotals(sent=sample(5, 2000, retr=1), received=sample(5, 2000, sender=False), local_sender=False)
    unknown = StreamTotals(sent=sample(5, 2000), received=sample(5, 2000, sender=False))
    streams = end_json([local, remote, unknown], cpu={}, sender_congestion=None, receiver_congestion=None)["streams"]
    assert list(streams[0]["sender"])[-7:] == ["retransmits", "max_snd_cwnd", "max_snd_wnd", "max_rtt", "min_rtt",
                                               "mean_rtt", "sender"]  # iperf3's order
    assert streams[0]["sender"]["max_snd_cwnd"] == 64000 and streams[0]["sender"]["mean_rtt"] == 40000
    assert streams[1]["sender"]["max_rtt"] == 0 and streams[1]["sender"]["sender"] is False  # the peer sent it
    assert "max_rtt" not in streams[2]["sender"] and "max_rtt" not in streams[0]["receiver"]


def test_interval_json_reports_the_send_window():
    row = StreamSample(id=5, start=0.0, end=1.0, bytes=10, sender=True, retransmits=0, snd_cwnd=1000, snd_wnd=65536,
                       rtt_us=50, rttvar_us=5, pmtu=1500)
    assert list(row.to_json())[6:] == ["retransmits", "snd_cwnd", "snd_wnd", "rtt", "rttvar", "pmtu", "omitted",
                                       "sender"]  # iperf3's order
    assert row.to_json()["snd_wnd"] == 65536
