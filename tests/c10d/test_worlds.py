"""The test worlds' start line: every rank waits for the others before init_process_group, bounded."""
import pytest

from tests.support.worlds import _wait_for_every_rank


class CountingStore:
    """The one store call the start line makes: ``add(key, amount)`` returns the new count."""

    def __init__(self, already: int = 0):
        self.count = already

    def add(self, key: str, amount: int) -> int:
        assert key == "worlds/imported"
        self.count += amount
        return self.count


def test_the_start_line_opens_once_every_rank_has_arrived():
    store = CountingStore(already=2)
    _wait_for_every_rank(store, 3, within_s=5.0)
    assert store.count == 3


def test_a_rank_that_never_arrives_is_reported_with_how_many_did():
    with pytest.raises(TimeoutError, match=r"only 2 of 3 ranks started within 0 s"):
        _wait_for_every_rank(CountingStore(already=1), 3, within_s=0.05)
