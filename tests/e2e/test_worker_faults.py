"""Migration with worker processes, as in production: one prefill and three decode workers (real gRPC,
real NIXL between processes, a real Redis), the router in this process. A decode worker SIGKILLed
mid-stream, then another SIGSTOPped mid-stream: each stream just goes on on another decode worker,
token for token what the unfaulted run gives (greedy = HF; seeded sampling = its unfaulted run), the
stopped one is given up on by the stall watch while it is still stopped, and once it runs again it
frees what it held, like every other surviving worker. Then the prefill worker is SIGSTOPped: its
call is given up on by the prefill stall watch and the request runs aggregated, token-identical."""

from __future__ import annotations

import asyncio
import signal

from test_router import Cluster

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto.convert import params_to_proto
from router.migration import MigrationOptions
from router.router import Router

PROMPT = list(range(11, 40))
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=30, seed=77, max_tokens=60, ignore_eos=True)


def test_killed_and_stopped_decode_workers_lose_no_token(workers, redis_server, tiny_llama, hf_greedy):
    cluster = Cluster(workers, redis_server, num_prefill=1, num_decode=3)
    cluster.router = Router(cluster.view, "cache_aware", migration=MigrationOptions(stall_floor_s=3.0))
    procs = {f"d{i}": p for i, p in enumerate(cluster.decodes)}

    async def faulted(rid: str, params: SamplingParams, fault) -> list[int]:
        """The request's tokens; ``fault(decode worker id)`` once a few streamed from it."""
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, params=params_to_proto(params))
        tokens, victim = [], None
        async for msg in cluster.stub.Generate(req, timeout=120):
            assert msg.WhichOneof("kind") != "error", msg.error
            if msg.HasField("route") and victim is None:
                victim = msg.route.decode_worker
            tokens.extend(msg.tokens.token_ids)
            if victim is not None and len(tokens) >= 4 and rid not in faulted.done:
                faulted.done.add(rid)
                fault(victim)
        return tokens

    faulted.done = set()
    stopped: list[str] = []

    def kill(wid: str) -> None:
        procs[wid].kill()

    def stop(wid: str) -> None:
        procs[wid].proc.send_signal(signal.SIGSTOP)
        stopped.append(wid)

    async def body() -> None:
        seeded_ref = await cluster.generate("seeded-ref", PROMPT, SEEDED)
        assert await faulted("greedy", GREEDY, kill) == hf_greedy(tiny_llama, PROMPT, GREEDY.max_tokens)
        assert await faulted("seeded", SEEDED, stop) == seeded_ref
        s = cluster.router.stats
        assert (s.migrations, s.stalls, s.migrations_refused) == (2, 1, 0)
        cs = await cluster.stub.GetClusterState(pb.ClusterStateRequest())
        assert stopped[0] in cs.suspect_workers and cs.migrations == 2
        procs[stopped.pop()].proc.send_signal(signal.SIGCONT)  # back: it aborts the moved request
        await cluster.all_free()  # every surviving worker, the stopped one too, has all blocks free
        # The prefill worker stopped: its Prefill call gets no answer and its heartbeats stop; the
        # router gives up on it after the stall deadline and, with no other prefill worker, the
        # request runs aggregated on a decode worker, token-identical.
        procs["p0"] = cluster.prefills[0]
        stop("p0")
        assert await cluster.generate("after-prefill-stall", PROMPT, GREEDY) == hf_greedy(
            tiny_llama, PROMPT, GREEDY.max_tokens
        )
        assert cluster.router.stats.stalls == 2 and "p0" in cluster.router.suspects
        procs[stopped.pop()].proc.send_signal(signal.SIGCONT)
        await cluster.all_free()

    async def run() -> None:
        await cluster.start()
        try:
            await body()
        finally:
            for wid in stopped:
                procs[wid].proc.send_signal(signal.SIGCONT)
            await cluster.stop()

    asyncio.run(run())
