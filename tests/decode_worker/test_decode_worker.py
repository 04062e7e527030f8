"""The decode worker alone (no gRPC, no NIXL): a prefill worker on the same in-process fabric holds
real KV, the decode worker pulls it (``decode_worker.kv_pull``) and continues the request.

Greedy output is token-identical to the engine alone, whether the KV was pulled or recomputed after
a failed read; the ``fail`` policy ends the stream with a ``KVTransferError``; a pull without room
waits its turn (FIFO); an aborted or timed-out read frees its blocks only once it has settled. After
every test every block is free on both sides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from decode_worker.kv_pull import IncompatibleKVError, KVTransferError, PulledKV, PullState
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer import InProcessBackend, InProcessFabric, KVCompat, RemoteKVInfo
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig

BLOCK = 4
P_BLOCKS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(31 * i + 17 * seed) % 1000 + 3 for i in range(n)]


async def wait_until(cond: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds; the generous deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not await _value(cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _value(v: bool | Awaitable[bool]) -> bool:
    return await v if inspect.isawaitable(v) else v


class RecordingBackend(InProcessBackend):
    """Remembers the reads started, in order: request id (the notify message) -> blocks read."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.reads: dict[str, int] = {}
        self.timeouts: dict[str, float] = {}  # request id -> the read's timeout

    @property
    def started(self) -> list[str]:
        return list(self.reads)

    def start_read(self, remote_agent, remote_block_ids, local_block_ids, notify, timeout_s):
        self.reads[notify.decode()] = len(local_block_ids)
        self.timeouts[notify.decode()] = timeout_s
        return super().start_read(remote_agent, remote_block_ids, local_block_ids, notify, timeout_s)


@dataclasses.dataclass
class Pair:
    fabric: InProcessFabric
    p: PrefillWorker
    d: DecodeWorker
    d_blocks: int
    p_blocks: int = P_BLOCKS

    async def prefill(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> PulledKV:
        return pulled_kv(self.p, await self.p.prefill(rid, prompt, params), "prefill-0:1")

    async def decode(self, rid, prompt, kv: PulledKV, params=GREEDY, policy=None) -> list[int]:
        """The whole continuation, the first token (from the prefill side) included."""
        return await collect(kv.first_token, self.d.decode(rid, prompt, params, kv=kv, policy=policy))

    async def generate(self, rid, prompt, params=GREEDY, policy=None) -> list[int]:
        return await self.decode(rid, prompt, await self.prefill(rid, prompt, params), params, policy)

    async def state(self, rid: str) -> PullState | None:
        return await self.d.loop.run(lambda: self.d.pulls.state_of(rid))

    async def wait_state(self, rid: str, state: PullState) -> None:
        async def reached() -> bool:
            return await self.state(rid) is state

        await wait_until(reached, f"pull {rid} to be {state.name}")

    async def all_free(self) -> bool:
        p, d = await self.p.stats(), await self.d.stats()
        return (
            p.num_free_blocks == self.p_blocks
            and p.num_held == 0
            and d.num_free_blocks == self.d_blocks
            and d.num_held == 0
            and d.num_running == d.num_waiting == d.num_transferring == 0
            and await self.d.busy() == 0
        )

    async def wait_all_free(self) -> None:
        try:
            await wait_until(self.all_free, "every block free on both sides")
        except AssertionError as e:
            raise AssertionError(
                f"{e}: prefill {await self.p.stats()}, decode {await self.d.stats()}"
            ) from None


def pulled_kv(p: PrefillWorker, res, address: str) -> PulledKV:
    """What a decode worker gets of the prefill worker ``p``'s result ``res`` (its KV handle)."""
    return PulledKV(
        agent_name=p.transfer_info().agent_name,
        address=address,
        block_ids=res.block_ids,
        num_tokens=res.num_tokens,
        compat_hash=p.compat.hash(),
        first_token=res.first_token,
        first_logprobs=res.first_logprobs,
        seed=res.seed,
        lease_expiry_unix=res.lease_expiry_unix,
    )


async def collect(first: int, stream: AsyncIterator[SequenceOutput]) -> list[int]:
    tokens = [first]
    async for out in stream:
        tokens.extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def engine_alone(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64)
    return lambda prompt, params=GREEDY: llm.generate([prompt], params, use_tqdm=False)[0].token_ids


@pytest.fixture
def make_pair(tiny_llama):
    """``make(d_blocks=64, p_blocks=P_BLOCKS, lease_s=600, **decode_config)`` -> started prefill and
    decode workers on one fabric (the lease long by default: blocks are freed by notifications)."""
    started: list[Pair] = []

    def make(d_blocks: int = 64, p_blocks: int = P_BLOCKS, lease_s: float = 600, **decode_kw) -> Pair:
        fabric = InProcessFabric()
        p = PrefillWorker(
            PrefillWorkerConfig(
                EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=p_blocks),
                lease_seconds=lease_s,
            ),
            fabric.transfer_factory,
        )

        async def fetch_peer(address: str) -> RemoteKVInfo:
            return p.transfer_info()

        def transfer(core, name: str, compat: KVCompat) -> RecordingBackend:
            return RecordingBackend(fabric, name, core.runner.kv_cache, compat)

        d = DecodeWorker(
            DecodeWorkerConfig(
                EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=d_blocks), **decode_kw
            ),
            fetch_peer=fetch_peer,
            transfer_factory=transfer,
        )
        started.append(pair := Pair(fabric, p, d, d_blocks, p_blocks))
        p.start()
        d.start()
        return pair

    yield make
    for pair in started:
        pair.d.stop()
        pair.p.stop()


@pytest.mark.parametrize("prompt_len", [3, BLOCK, 5 * BLOCK + 3], ids=["short", "one-block", "many-blocks"])
def test_pulled_request_equals_engine_alone(make_pair, engine_alone, prompt_len):
    pair = make_pair()
    prompt = _prompt(prompt_len, prompt_len)

    async def run():
        assert await pair.generate("r", prompt) == engine_alone(prompt)
        # The same prompt again: the decode side's own cached blocks are not pulled a second time.
        assert await pair.generate("again", prompt) == engine_alone(prompt)
        stats = await pair.d.transfer_snapshot()
        assert stats.completed >= 1 and stats.failures == stats.recomputed == 0
        blocks = -(-prompt_len // BLOCK)
        full_hits = (prompt_len - 1) // BLOCK  # the decode side's cached full blocks
        assert pair.d.transfer.reads == {"r": blocks, "again": blocks - full_hits}
        await pair.wait_all_free()
        assert pair.p.released["notification"] == 2

    asyncio.run(run())


def test_failed_read_recomputes_to_identical_output(make_pair, engine_alone):
    pair = make_pair(kv_failure_policy="recompute")
    prompt = _prompt(3 * BLOCK + 1, 1)

    async def run():
        pair.fabric.fail_next_reads(1)
        assert await pair.generate("r", prompt) == engine_alone(prompt)
        stats = await pair.d.transfer_snapshot()
        assert stats.failures == 1 and stats.recomputed == 1 and stats.completed == 0
        await pair.wait_all_free()

    asyncio.run(run())


def test_failed_read_under_fail_policy_raises(make_pair):
    pair = make_pair(kv_failure_policy="fail")

    async def run():
        pair.fabric.fail_next_reads(1)
        with pytest.raises(KVTransferError):
            await pair.generate("r", _prompt(2 * BLOCK + 2, 2))
        stats = await pair.d.transfer_snapshot()
        assert stats.failures == 1 and stats.recomputed == 0
        await pair.wait_all_free()

    asyncio.run(run())


def test_incompatible_kv_handle_is_refused(make_pair):
    pair = make_pair()
    prompt = _prompt(2 * BLOCK, 3)

    async def run():
        kv = await pair.prefill("r", prompt)
        other = dataclasses.replace(pair.d.compat, block_size=2 * BLOCK)
        with pytest.raises(IncompatibleKVError):
            await pair.decode("r", prompt, dataclasses.replace(kv, compat_hash=other.hash()))
        assert pair.d.transfer.started == []
        assert await pair.p.release("r")  # what the router does when the decode call failed
        await pair.wait_all_free()

    asyncio.run(run())


def test_pull_without_room_waits_then_proceeds_fifo(make_pair, engine_alone):
    """8 decode blocks: A (3 blocks) is stalled mid-read; B (6) cannot fit and waits; C (2) would
    fit, but waits behind B. Once A's read lands and A finishes, B and then C are pulled."""
    pair = make_pair(d_blocks=8, transfer_timeout_s=120)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {"a": _prompt(9, 4), "b": _prompt(21, 5), "c": _prompt(5, 6)}

    async def run():
        kvs = {rid: await pair.prefill(rid, prompt, params) for rid, prompt in prompts.items()}
        pair.fabric.stall_reads()
        tasks = {}
        for rid, state in [("a", PullState.READING), ("b", PullState.WAITING_FOR_ROOM), ("c", None)]:
            tasks[rid] = asyncio.ensure_future(pair.decode(rid, prompts[rid], kvs[rid], params))
            await pair.wait_state(rid, state or PullState.WAITING_FOR_ROOM)  # C: though it would fit
        assert (await pair.d.stats()).num_free_blocks == 5  # C's 2 blocks would fit
        assert (await pair.d.transfer_snapshot()).waited == 2
        assert pair.d.transfer.started == ["a"]
        pair.fabric.resume_reads()
        for rid, task in tasks.items():
            assert await task == engine_alone(prompts[rid], params), rid
        assert pair.d.transfer.started == ["a", "b", "c"]
        stats = await pair.d.transfer_snapshot()
        assert stats.completed == 3 and stats.recomputed == stats.failures == 0
        assert stats.descriptors >= 3  # at least one run of blocks per pull
        await pair.wait_all_free()

    asyncio.run(run())


def test_abort_during_stalled_read_frees_blocks_only_once_it_settled(make_pair):
    pair = make_pair(transfer_timeout_s=120)
    prompt = _prompt(4 * BLOCK + 1, 7)
    ticks = [0]
    pair.d.loop.add_tick(lambda: ticks.__setitem__(0, ticks[0] + 1))

    async def run():
        kv = await pair.prefill("r", prompt)
        pair.fabric.stall_reads()
        task = asyncio.ensure_future(pair.decode("r", prompt, kv))
        await pair.wait_state("r", PullState.READING)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await pair.wait_state("r", PullState.ABORTING)
        # Let the engine loop poll the stalled read many times: the blocks stay allocated.
        seen = ticks[0]
        await wait_until(lambda: ticks[0] >= seen + 20, "the engine loop to tick")
        assert await pair.state("r") is PullState.ABORTING
        assert (await pair.d.stats()).num_free_blocks == 64 - 5
        pair.fabric.resume_reads()
        await pair.wait_all_free()  # the read landed: the decode side frees, the prefill side is notified
        assert await pair.state("r") is None
        assert pair.p.released["notification"] == 1

    asyncio.run(run())


def test_timed_out_read_quarantines_blocks_until_it_settles(make_pair, engine_alone):
    pair = make_pair(kv_failure_policy="recompute", transfer_timeout_s=0.2)
    prompt = _prompt(3 * BLOCK + 2, 8)

    async def run():
        kv = await pair.prefill("r", prompt)
        pair.fabric.stall_reads()
        assert await pair.decode("r", prompt, kv) == engine_alone(prompt)  # recomputed meanwhile
        stats = await pair.d.transfer_snapshot()
        assert stats.failures == 1 and stats.recomputed == 1
        d = await pair.d.stats()
        assert d.num_held == 1 and d.num_free_blocks == 64 - 4  # the 4 read blocks, quarantined
        assert pair.d.transfer.in_flight == 1
        pair.fabric.resume_reads()
        await pair.wait_all_free()
        assert pair.d.transfer.in_flight == 0

    asyncio.run(run())


def test_a_handle_whose_lease_is_over_is_recomputed_not_read(make_pair, engine_alone):
    """The prefill worker frees a prompt when its lease ends and reuses the blocks for the next
    prompts: a handle that comes later must not be read (that would decode another prompt's KV)."""
    pair = make_pair(p_blocks=12, lease_s=0.5)
    a, b = _prompt(4 * BLOCK + 2, 21), _prompt(7 * BLOCK + 2, 22)  # 5 and 8 blocks: B reuses A's

    async def run():
        kv = await pair.prefill("a", a)

        async def expired() -> bool:
            return (await pair.p.stats()).num_held == 0

        await wait_until(expired, "A's lease to end")
        assert pair.p.held.stats.expired_leases == 1
        held_b = (await pair.p.prefill("b", b, GREEDY)).block_ids
        assert set(kv.block_ids) & set(held_b), "B does not hold A's old blocks: nothing to see"
        assert await pair.decode("a", a, kv) == engine_alone(a)
        stats = await pair.d.transfer_snapshot()
        assert "a" not in pair.d.transfer.reads, "read the blocks of a lease that was over"
        assert stats.recomputed == 1 and stats.completed == 0
        await pair.wait_all_free()  # B's lease frees it

    asyncio.run(run())


def test_a_read_is_bounded_by_the_lease_left(make_pair, engine_alone):
    """A read's timeout is cut to the owner's lease left (less a margin): one that cannot land in
    time fails (quarantine, recompute) instead of copying blocks already reused."""
    pair = make_pair(transfer_timeout_s=120, lease_s=30)
    prompt = _prompt(3 * BLOCK + 2, 23)

    async def run():
        kv = await pair.prefill("r", prompt)
        assert await pair.decode("r", prompt, kv) == engine_alone(prompt)
        lease_left = kv.lease_expiry_unix - time.time()
        assert 0 < pair.d.transfer.timeouts["r"] < lease_left, pair.d.transfer.timeouts
        await pair.wait_all_free()

    asyncio.run(run())
