"""bench/e2e_training.py's StallWatchdog: a rank that stops making progress ends itself, naming
where it stands (its stacks, and what each link still sends and awaits), instead of hanging the bench."""
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from bench.e2e_training import STALL_EXIT

ROOT = Path(__file__).resolve().parents[2]

STUCK_RANK = textwrap.dedent("""
    import asyncio, threading, time
    from bench.e2e_training import StallWatchdog
    from tests.support.links import open_pair

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    pair = asyncio.run_coroutine_threadsafe(open_pair(streams=2), loop).result(20)
    asyncio.run_coroutine_threadsafe(pair.accepted.recv_into(bytearray(1000), tag=9), loop)  # never sent
    watchdog = StallWatchdog(1.0, rank=3)
    watchdog.tick()

    def waiting_for_an_exchange_that_never_comes():
        time.sleep(60)

    waiting_for_an_exchange_that_never_comes()
""")


def test_a_stalled_rank_exits_with_its_stacks_and_link_state():
    proc = subprocess.run([sys.executable, "-c", STUCK_RANK], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == STALL_EXIT, proc.stderr
    assert re.search(r"rank 3: no progress for \d+ s", proc.stderr)  # (checked once a second)
    assert "waiting_for_an_exchange_that_never_comes" in proc.stderr  # the main thread's stack
    assert '"receives_pending": 1' in proc.stderr and '"sends_pending": 0' in proc.stderr
    assert '"bytes_sent"' in proc.stderr  # the counters follow


def test_a_rank_that_keeps_ticking_is_left_alone_and_exits_with_its_watchdog_running():
    ticking = STUCK_RANK[:STUCK_RANK.index("def waiting_for")] + textwrap.dedent("""
        for _ in range(5):  # progress every 0.5 s: never stalled
            time.sleep(0.5)
            watchdog.tick()
    """)
    proc = subprocess.run([sys.executable, "-c", ticking], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "no progress" not in proc.stderr
