"""wanlink.io: the asyncio transport (Link, Stream, server, socket helpers, the loop thread).

It takes resolved values (stream count, secret, chunk size), reads no environment and never
probes: ``wanlink.connect``/``serve`` (wanlink/endpoints.py) do that above it.
"""
