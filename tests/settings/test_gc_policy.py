"""A server process's collector once it serves (``settings.gc_policy``): the start-up heap frozen,
the young generation's threshold raised, garbage made afterwards still collected, and the frozen
heap handed back at exit. Each check runs
in a fresh interpreter: freezing this test process's heap would change every test after it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SETTLE = """
    import gc, json, weakref
    from settings.gc_policy import YOUNG_THRESHOLD, settle_heap
    import asyncio, argparse, triton.language  # start-up objects, as a server's imports leave them
    before = gc.get_freeze_count()
    frozen = settle_heap()

    class Node:
        pass

    node = Node()
    node.me = node  # a cycle made after start-up: only the collector frees it
    ref = weakref.ref(node)
    del node
    gc.collect()
    print(json.dumps({"before": before, "frozen": frozen, "threshold": gc.get_threshold()[0],
                      "young": YOUNG_THRESHOLD, "collected": ref() is None}))
"""


def _run(script: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    # Frozen objects are handed back at exit: no extension reports them leaked (nanobind, in Triton).
    assert "leaked" not in done.stderr, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_settling_freezes_the_start_up_heap_and_still_collects_what_comes_after():
    out = _run(SETTLE)
    assert out["before"] == 0
    assert out["frozen"] > 10_000  # the interpreter's and the imports' objects
    assert out["threshold"] == out["young"] > 700  # above CPython's default
    assert out["collected"]


def test_a_worker_process_settles_its_heap_before_it_says_it_listens():
    """``serve_until_signal`` (``python -m decode_worker`` / ``prefill_worker``): by the time the
    supervisor reads LISTENING, the heap is settled."""
    out = _run(
        """
        import asyncio, gc, json, os, signal
        from settings.gc_policy import YOUNG_THRESHOLD
        from worker.process import serve_until_signal

        class Worker:
            async def shutdown(self, grace_s):
                pass

        seen = {}

        async def serve(worker, host, port):
            # what the process looks like when it is about to announce itself, then a supervisor's stop
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
            return None, "127.0.0.1:1"

        real_print = print

        def watch_print(*args, **kw):
            seen["frozen_at_listening"] = gc.get_freeze_count()
            seen["threshold_at_listening"] = gc.get_threshold()[0]
            real_print(*args, **kw)

        import builtins
        builtins.print = watch_print
        asyncio.run(serve_until_signal(Worker(), serve, "127.0.0.1", 0))
        builtins.print = real_print
        print(json.dumps(seen | {"young": YOUNG_THRESHOLD}))
        """
    )
    assert out["frozen_at_listening"] > 10_000
    assert out["threshold_at_listening"] == out["young"]
