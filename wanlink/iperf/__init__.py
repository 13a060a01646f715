"""wanlink-iperf: iperf3's command line and wire protocol, with wanlink Links as the data path.

``-c HOST`` against a stock ``iperf3 -s`` runs an ordinary iperf3 TCP test. Against
``wanlink-iperf -s`` the client asks (in the parameters, invisibly to stock iperf3) for a wanlink
test: the data then goes over one wanlink Link of N striped streams on ``PROBE_DISCARD_TAG``, with
N probed automatically unless ``-P`` is given. ``-s`` serves stock iperf3 clients and
wanlink-iperf clients on the same port: it owns the listening socket, reads the first bytes of
each connection, and hands wanlink handshakes (``WLK1``) to the wanlink server.

Modules, bottom up: ``protocol`` (sans-I/O control connection) and ``messages`` (parameters and
results), ``report`` (table and ``-J``, pure), ``options``, ``output``, ``channels`` (sockets and
Link streams), ``measure``, then ``client``, ``session`` and ``server``, and ``cli`` (``main``).
"""
