"""The cell leader's handling of a source's numbered reports (StripedP2P._lead), without sockets:
a report far ahead of the next one due is refused at once, naming the rank, the transfer and the
numbers, and the transfer gives its turn up instead of holding the cell until its timeout."""
import pytest

from wanlink.c10d.striped_p2p import StripedP2P
from wanlink.errors import ConfigError
from wanlink.sched.cells import CellScheduler
from wanlink.sched.stripes import REPORT_WINDOW

MiB = 1 << 20


class Leader(StripedP2P):
    """Rank 0, leader of the cell (0, 1); control messages it would send are recorded."""

    def __init__(self):  # no mesh: only what the leader's bookkeeping touches
        self.rank, self.handed_over, self.finished = 0, 0, []
        self.scheduler = CellScheduler([0, 1], [100e6, 100e6], lambda: 0.0)
        self._granted, self._reports, self.sent = set(), {}, []

    def _tell(self, rank, message):
        self.sent.append((rank, message))


def test_a_report_far_ahead_gives_the_turn_up_with_an_error_naming_rank_transfer_and_numbers():
    leader = Leader()
    leader._lead(1, "request", [3, 64 * MiB])  # rank 1's transfer 3: granted at once
    leader._lead(1, "request", [4, 64 * MiB])  # its next waits for the turn
    assert [message[:2] for _rank, message in leader.sent] == [["grant", 3]]
    leader._lead(1, "dealt", [3, 1])  # 1 ahead of 0: held, as a reordered report may be
    assert leader.scheduler.active((1, 3)) and [m[:2] for _r, m in leader.sent] == [["grant", 3]]
    with pytest.raises(ConfigError, match=rf"rank 1's striped transfer 3 .*item {REPORT_WINDOW} came while 0"):
        leader._lead(1, "moved", [3, REPORT_WINDOW, 0, 1, MiB])
    assert not leader.scheduler.active((1, 3)) and (1, 3) not in leader._reports  # its turn given up
    assert [m[:2] for _r, m in leader.sent] == [["grant", 3], ["grant", 4]]  # the next transfer goes on
    leader._lead(1, "done", [3, 0, 1, MiB])  # its late reports are ignored
    assert not leader.scheduler.active((1, 3))
