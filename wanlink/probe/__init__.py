"""wanlink.probe: how many streams and how large chunks a link needs, and how fast it delivers.

Pure decision logic (``StreamRamp``, ``choose_chunk_size``, ``DeliveryRateEstimator``) and
``choose_streams`` (``wanlink.probe.driver``), which drives the ramp over real Links and is loaded
on first use so the pure parts never import the transport. (The iperf3 protocol and reports live
in ``wanlink.iperf``.)
"""
from wanlink.probe.chunk import choose_chunk_size
from wanlink.probe.ramp import ProbeResult, RampStep, StreamRamp
from wanlink.probe.rate import DeliveryRateEstimator

__all__ = ["DeliveryRateEstimator", "ProbeResult", "RampStep", "StreamRamp", "choose_chunk_size", "choose_streams"]


def __getattr__(name):
    if name == "choose_streams":
        from wanlink.probe.driver import choose_streams

        return choose_streams
    raise AttributeError(f"module 'wanlink.probe' has no attribute {name!r}")
