"""iperf3's parameters and results messages: round trips, stock iperf3's quirks, and what is refused."""
import json

import pytest

from tests.support.iperf import PARAMS, RESULTS
from wanlink.errors import RemoteProtocolError, UnsupportedError
from wanlink.iperf.messages import TestParameters, TestResults


def test_parameters_round_trip_and_defaults():
    params = TestParameters(time=5, parallel=8, reverse=True, window=1 << 20, congestion="bbr",
                            wanlink={"version": 1})
    again = TestParameters.from_json(json.loads(json.dumps(params.to_json())))
    assert again.time == 5 and again.parallel == 8 and again.reverse and not again.bidirectional
    assert again.window == 1 << 20 and again.congestion == "bbr" and again.wanlink == {"version": 1}
    stock = TestParameters.from_json(PARAMS)
    assert stock.parallel == 2 and stock.len == 131072 and stock.wanlink is None


@pytest.mark.parametrize("patch", [
    {"parallel": 0}, {"parallel": 129}, {"time": -1}, {"time": 86401}, {"len": 2 << 20}, {"parallel": "2"},
    {"time": True}, {"congestion": 7}, {"congestion": "x" * 17}, {"window": 1 << 40}, {"wanlink": [1]},
    {"time": 0, "num": 0, "blockcount": 0}, {"time": float("nan")},
])
def test_bad_parameters_are_protocol_errors(patch):
    with pytest.raises(RemoteProtocolError):
        TestParameters.from_json({**PARAMS, **patch})


def test_udp_is_unsupported():
    with pytest.raises(UnsupportedError):
        TestParameters.from_json({"udp": True, "time": 1})


def test_results_round_trip_and_iperf3_quirks():
    res = TestResults.from_json(RESULTS)
    assert res.streams[0].id == 1 and res.streams[0].bytes == 1000 and res.congestion_used == "cubic"
    assert TestResults.from_json(res.to_json()).to_json() == res.to_json()
    # iperf3 3.12 sends an unknown count as (uint64)-1
    quirky = {**RESULTS, "sender_has_retransmits": 2**64 - 1,
              "streams": [{**RESULTS["streams"][0], "retransmits": 2**64 - 1}]}
    res = TestResults.from_json(quirky)
    assert res.sender_has_retransmits == -1 and res.streams[0].retransmits == -1


@pytest.mark.parametrize("broken", [
    {k: v for k, v in RESULTS.items() if k != "streams"},
    {**RESULTS, "streams": "no"},
    {**RESULTS, "streams": [1]},
    {**RESULTS, "streams": [{"id": 1}]},
    {**RESULTS, "streams": [{**RESULTS["streams"][0], "bytes": -5}]},
    {**RESULTS, "streams": [RESULTS["streams"][0]] * 257},
    {**RESULTS, "cpu_util_total": "high"},
])
def test_bad_results_are_protocol_errors(broken):
    with pytest.raises(RemoteProtocolError):
        TestResults.from_json(broken)
