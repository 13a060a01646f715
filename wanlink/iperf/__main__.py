"""``python -m wanlink.iperf``: the same as the ``wanlink-iperf`` command."""
import sys

from wanlink.iperf.cli import main

sys.exit(main())
