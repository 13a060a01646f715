"""wanlink.probe: how many streams and how large chunks a link needs, and how fast it delivers.

Pure decision logic, below the transport: ``StreamRamp`` (wanlink.probe.ramp), ``StepTiming`` and
``inflight_bytes_for`` (wanlink.probe.step), ``choose_chunk_size`` (wanlink.probe.chunk),
``DeliveryRateEstimator`` (wanlink.probe.rate). Driving the ramp over real Links
(``choose_streams``) is ``wanlink.endpoints``, above the transport; the iperf3 protocol and
reports are ``wanlink.iperf``.
"""
from wanlink.probe.chunk import choose_chunk_size
from wanlink.probe.ramp import ProbeResult, RampStep, StreamRamp
from wanlink.probe.rate import DeliveryRateEstimator
from wanlink.probe.step import StepTiming, inflight_bytes_for

__all__ = ["DeliveryRateEstimator", "ProbeResult", "RampStep", "StepTiming", "StreamRamp", "choose_chunk_size",
           "inflight_bytes_for"]
