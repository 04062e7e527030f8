"""How a long-running pdserve process sets CPython's cyclic garbage collector, once it serves.

A server process imports torch, transformers, grpc, uvicorn, Ray: 200k-350k objects that live as long
as the process does. CPython's collector is generational; a full (oldest-generation) collection scans
every tracked object, those start-up ones included, and stops the process while it does. Measured on
the standalone stack (``bench.served_path``, disaggregated, 16 in / 16 out, 2 cores), the ingress with
the router inside spent 17-22% of its CPU in the collector: two full collections in 12-20 s of load,
240-300 ms each (each one a pause every stream through that process shares), and ~500 young
collections, ~1 ms each. The decode worker's gRPC side spent 12-13%.

``settle_heap`` is called once a process is ready to serve (the ingress, the router, each worker
and its engine process, each Serve replica): it collects once, freezes what is left
(``gc.freeze``: into a permanent generation that no later collection scans) and raises the youngest
generation's threshold, so a request's short-lived objects are freed by reference counting before
a collection sees them and fewer survive into the older generations. Objects created afterwards are
collected as before; only the start-up heap, which never becomes garbage, is left alone.

vLLM freezes its API server's and engine core's start-up heap the same way.
"""

from __future__ import annotations

import atexit
import gc
import logging

logger = logging.getLogger(__name__)

# Net tracked allocations between two young collections (CPython's default is 700). Larger means
# fewer collections and fewer promotions, but a longer pause when one comes: measured in the ingress
# under load on a 2-core machine, 16-28 young collections in 10-15 s of 4.5-6 ms on average (9-17 ms
# at most), against ~500 of 0.7 ms at 700 (bench/README, "The collector").
YOUNG_THRESHOLD = 5_000


def settle_heap(young_threshold: int = YOUNG_THRESHOLD) -> int:
    """Collect, freeze the surviving heap and raise the young generation's threshold; the number of
    objects frozen. Safe to call again (what survived since is frozen too)."""
    gc.collect()
    if not gc.get_freeze_count():
        # At exit the frozen objects go back to the collector: the interpreter's last collection
        # frees them, and extensions that count their objects at exit (nanobind's, in Triton) find
        # none leaked.
        atexit.register(gc.unfreeze)
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
    frozen = gc.get_freeze_count()
    logger.info("start-up heap settled: %d objects frozen, young threshold %d", frozen, young_threshold)
    return frozen
