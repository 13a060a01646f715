"""Running wanlink-iperf in-process (server and client on the test's event loop) and stock iperf3."""
import asyncio
import io
import json
import shutil

from wanlink.iperf.cli import run

# what stock iperf3 3.12 sends: its parameters and its results
PARAMS = {"tcp": True, "omit": 0, "time": 10, "num": 0, "blockcount": 0, "parallel": 2, "len": 131072,
          "pacing_timer": 1000, "client_version": "3.12"}
RESULTS = {"cpu_util_total": 1.5, "cpu_util_user": 0.5, "cpu_util_system": 1.0, "sender_has_retransmits": 1,
           "congestion_used": "cubic",
           "streams": [{"id": 1, "bytes": 1000, "retransmits": 3, "jitter": 0, "errors": 0, "packets": 0,
                        "start_time": 0, "end_time": 10.0}]}
LIMIT = 60.0  # no test may wait longer than this for one run
IPERF3 = shutil.which("iperf3")


class Server:
    """``wanlink-iperf -s`` on 127.0.0.1 and a free port, stopped on exit."""

    def __init__(self, *extra: str):
        self.extra = extra
        self.out, self.err = io.StringIO(), io.StringIO()
        self.stop = asyncio.Event()
        self.rc = None

    async def __aenter__(self):
        ready = asyncio.get_running_loop().create_future()
        self.task = asyncio.ensure_future(run(["-s", "-p", "0", "-B", "127.0.0.1", "-i", "0", *self.extra],
                                              stdout=self.out, stderr=self.err, stop=self.stop,
                                              on_listening=ready.set_result))
        done, _ = await asyncio.wait({ready, self.task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert ready in done, f"server did not start: {self.err.getvalue()}"
        self.port = ready.result()
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        self.rc = await asyncio.wait_for(self.task, LIMIT)


async def client(*args: str) -> tuple[int, str, str]:
    """Run ``wanlink-iperf -c ...`` in-process; returns (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    rc = await asyncio.wait_for(run(["-c", *args], stdout=out, stderr=err, stop=asyncio.Event()), LIMIT)
    return rc, out.getvalue(), err.getvalue()


async def client_json(*args: str) -> dict:
    rc, out, err = await client(*args, "-J")
    assert rc == 0, err
    return json.loads(out)


async def stock(*args: str) -> tuple[int, str, str]:
    """Run the real iperf3 binary; killed if it outlives LIMIT."""
    proc = await asyncio.create_subprocess_exec(IPERF3, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), LIMIT)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(), err.decode()
