"""The scheduler's side of a step's results: tokens appended, stops checked, forks made, the
prefill role's held blocks, and (overlapped scheduling) placeholders filled.

A sequence's sampled tokens arrive in ``update`` after the step that sampled them. Without overlap
that is before the next ``schedule``; with it, the next step was already scheduled with the token
as a PLACEHOLDER (``expect_tokens``), and ``update`` fills the oldest placeholder, checks stops on
it, and, if the request stopped there, drops the token of the step after (it is never output).
"""

from __future__ import annotations

from operator import attrgetter, ge, sub
from typing import TYPE_CHECKING

from engine.request import PLACEHOLDER, Request, RequestStatus
from engine.scheduler_output import PlainTokens, RunnerOutput, SchedulerOutput, SequenceOutput

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager


_status = attrgetter("status")
_placeholders = attrgetter("num_placeholders")


class StepResults:
    """Part of ``engine.scheduler.Scheduler`` (its state: requests, groups, running, kv)."""

    requests: dict[str, Request]
    groups: dict[str, list[str]]
    running: list[Request]
    kv: KVCacheManager
    max_model_len: int
    _repeat_ids: list[str] | None
    _repeat_requests: list[Request | None]
    _repeat_checks: tuple[list[int], frozenset[int], int] | None  # _update_steady's, per batch

    def expect_tokens(self, seq_ids: list[str]) -> None:
        """Overlapped scheduling: the step just launched samples a token for each of ``seq_ids``;
        each counts it (the next step decodes it, reading its value on the device) as a PLACEHOLDER
        until its value is in. A steady batch's ids (the runner's list, the same object each step)
        find their requests as ``update`` last looked them up."""
        reqs = self._repeat_requests if seq_ids is self._repeat_ids else None  # a steady batch's
        if reqs is None or None in reqs:
            reqs = map(self.requests.__getitem__, seq_ids)
        for req in reqs:  # NOTE: every sequence, every overlapped step
            req.token_ids.append(PLACEHOLDER)
            req.num_placeholders += 1

    def _resolve(self, req: Request, token: int, logprobs: list[dict[int, float]] | None) -> SequenceOutput:
        """Fill ``req``'s oldest placeholder and check stops on it; a request that stops there keeps
        none of the tokens after it (a later step's placeholder: that token is never output)."""
        tokens = req.token_ids
        at = len(tokens) - req.num_placeholders
        tokens[at] = token
        req.num_placeholders -= 1
        if logprobs:
            req.output_logprobs.append(logprobs[0])
        status = req.check_stop(self.max_model_len, at)
        if status is not None and req.num_placeholders:
            del tokens[at + 1 :]
            req.num_placeholders = 0
        return self._output(req, [token], logprobs, status)

    def update(
        self, sched: SchedulerOutput, result: RunnerOutput, plain: PlainTokens | None = None
    ) -> list[SequenceOutput]:
        """The step's outputs; with ``plain``, a lean request's token that did not end it goes
        there as a column entry instead (the engine process sends those as columns)."""
        outputs: list[SequenceOutput] = []
        if plain is not None:
            plain_reqs, plain_tokens = plain.requests.append, plain.tokens.append
        requests = self.requests
        running = RequestStatus.RUNNING
        all_logprobs = result.logprobs
        for seq_id, (start, entries) in result.prompt_logprobs.items():
            if seq_id in requests:
                requests[seq_id].record_prompt_logprobs(start, entries)
        spec = sched.num_spec_tokens
        max_len = self.max_model_len
        get, emit = requests.get, outputs.append
        overlapped = result.repeat_overlapped
        if result.repeat_ids and self._update_steady(
            result.repeat_ids, result.repeat_tokens, outputs, plain, overlapped
        ):
            pass  # a steady decode batch that nothing ends this step: appended (or filled in) in bulk
        elif overlapped:  # each token fills a placeholder: the per-request path below takes them
            result.sampled.update(zip(result.repeat_ids, [[t] for t in result.repeat_tokens]))
        elif result.repeat_ids:  # NOTE: a steady decode batch, every step: its samples as columns
            for req, tok in zip(self._requests_of(result.repeat_ids), result.repeat_tokens):
                if req is None or req.status is not running:
                    continue
                if not req.lean:  # forked samples: the general path (no placeholder, draft or fork here)
                    emit(self._append(req, [tok], None))
                    continue
                ids = req.token_ids
                ids.append(tok)
                n = len(ids)
                if tok in req.stop_token_set or n >= req.stop_len or n >= max_len:
                    emit(self._output(req, [tok], None, req.check_stop(max_len)))
                elif plain is not None:
                    plain_reqs(req)
                    plain_tokens(tok)
                else:
                    cached = req.num_cached_tokens
                    emit(SequenceOutput(
                        req.group_id, req.sample_index, [tok], None, None, None, req.prompt_len,
                        cached if cached > 0 else 0,
                    ))  # fmt: skip
        for seq_id, tokens in result.sampled.items():
            req = get(seq_id)
            if req is None:
                continue
            if req.lean and not (spec and seq_id in spec):
                # NOTE: every plain decode of every sequence, every step: one token, inline checks.
                ids = req.token_ids
                tok = tokens[0]
                pending = req.num_placeholders
                if pending:  # overlapped: preempted meanwhile or not, the value is its token
                    n = len(ids) - pending + 1
                    if tok in req.stop_token_set or n >= req.stop_len or n >= max_len:
                        emit(self._resolve(req, tok, None))
                        continue
                    ids[n - 1] = tok
                    req.num_placeholders = pending - 1
                elif req.status is running:
                    ids.append(tok)
                    n = len(ids)
                    if tok in req.stop_token_set or n >= req.stop_len or n >= max_len:
                        emit(self._output(req, tokens, None, req.check_stop(max_len)))
                        continue
                else:
                    continue
                if plain is not None:
                    plain_reqs(req)
                    plain_tokens(tok)
                    continue
                cached = req.num_cached_tokens  # -1 until first scheduled; a call to max() costs 30 us a step
                emit(SequenceOutput(
                    req.group_id, req.sample_index, tokens, None, None, None, req.prompt_len,
                    cached if cached > 0 else 0,
                ))  # fmt: skip
                continue
            logprobs = all_logprobs.get(seq_id) if all_logprobs else None
            if req.num_placeholders:  # overlapped: preempted meanwhile or not, the value is its token
                outputs.append(self._resolve(req, tokens[0], logprobs))
                continue
            if req.status != running:
                continue
            if seq_id in spec:  # its tokens in order; the rejected drafts' positions are rolled back
                req.num_computed_tokens -= spec[seq_id] + 1 - len(tokens)
                outputs.append(self._append(req, tokens, logprobs))
                continue
            if req.pending_forks:
                for i, tok in enumerate(tokens[1:], start=1):
                    outputs.append(self._fork(req, i, tok, logprobs[i] if logprobs else None))
                req.pending_forks = 0
            outputs.append(self._append(req, tokens[:1], logprobs[:1] if logprobs else None))
        return outputs

    def _update_steady(
        self,
        ids: list[str],
        tokens: list[int],
        outputs: list[SequenceOutput],
        plain: PlainTokens | None,
        overlapped: bool = False,
    ) -> bool:
        """A steady decode batch's samples, appended in one loop (``overlapped``: each filling its
        request's oldest placeholder), when its requests all run, all are lean, and no token stops
        one and no length reaches a limit (checked on the columns: a stop token of any of them, a
        length one short of its own limit; placeholders count, which only errs early); else False,
        and nothing changed (the per-request loop takes the step)."""
        reqs = self._requests_of(ids)
        if self.running != reqs and (None in reqs or set(map(_status, reqs)) != {RequestStatus.RUNNING}):
            return False  # (the running list in another order: the torch backend's, longest first)
        checks = self._repeat_checks
        if checks is None:  # once per batch: each one's length limit less one, all stops, the margin
            stops: set[int] = set()
            for r in reqs:
                stops.update(r.stop_token_set)
            limits = [min(r.stop_len, self.max_model_len) - 1 if r.lean else -1 for r in reqs]
            margin = min(map(sub, limits, map(len, (r.token_ids for r in reqs))))
            checks = self._repeat_checks = (limits, frozenset(stops), margin + len(reqs[0].token_ids))
        limits, stops, horizon = checks
        if not stops.isdisjoint(tokens):
            return False
        lists = [r.token_ids for r in reqs]
        # Each list grows by one token a step at most, the first (running) by exactly one: until it
        # reaches ``horizon``, no list is at its limit.
        if len(lists[0]) >= horizon and any(map(ge, map(len, lists), limits)):
            return False
        if overlapped:
            if not all(map(_placeholders, reqs)):
                return False
            for r, tok in zip(reqs, tokens):  # NOTE: every sequence, every overlapped steady step
                k = r.num_placeholders
                r.token_ids[len(r.token_ids) - k] = tok
                r.num_placeholders = k - 1
        else:
            for token_ids, tok in zip(lists, tokens):  # NOTE: every sequence, every steady step
                token_ids.append(tok)
        if plain is not None:
            plain.batch = reqs if not plain.requests else None
            plain.requests.extend(reqs)
            plain.tokens.extend(tokens)
        else:
            outputs.extend([
                SequenceOutput(r.group_id, r.sample_index, [t], None, None, None, r.prompt_len,
                               r.num_cached_tokens if r.num_cached_tokens > 0 else 0)
                for r, t in zip(reqs, tokens)
            ])  # fmt: skip
        return True

    def _requests_of(self, ids: list[str]) -> list[Request | None]:
        """The requests of a repeating batch's ids, looked up once per batch (``ids`` is the
        runner's list, the same object while the batch repeats). A request that ended after its
        step was scheduled (overlapped: the step before sampled its stop) is None; the runner drops
        it with the next step, which makes a new list. One that ends later keeps its object, whose
        status says so."""
        if ids is not self._repeat_ids:
            self._repeat_ids, self._repeat_requests = ids, [self.requests.get(s) for s in ids]
            self._repeat_checks = None
        return self._repeat_requests

    def _append(
        self, req: Request, tokens: list[int], logprobs: list[dict[int, float]] | None
    ) -> SequenceOutput:
        """Append a step's tokens (several after speculation) up to the first that ends the request."""
        if len(tokens) == 1:  # NOTE: every decode of every sequence, every step: kept lean
            req.token_ids.append(tokens[0])
            if logprobs:
                req.output_logprobs.append(logprobs[0])
            return self._output(req, tokens, logprobs, req.check_stop(self.max_model_len))
        status = None
        for i, token in enumerate(tokens):
            req.append_token(token, logprobs[i] if logprobs else None)
            status = req.check_stop(self.max_model_len)
            if status is not None:
                tokens = tokens[: i + 1]
                break
        return self._output(req, list(tokens), logprobs[: len(tokens)] if logprobs else None, status)

    def _output(
        self, req: Request, tokens: list[int], logprobs: list[dict[int, float]] | None, status
    ) -> SequenceOutput:
        out = SequenceOutput(
            req.group_id, req.sample_index, tokens, logprobs or None,
            num_prompt_tokens=req.prompt_len, num_cached_tokens=max(req.num_cached_tokens, 0),
            prompt_logprobs=req.first_output_prompt_logprobs() if req.prompt_logprobs is not None else None,
        )  # fmt: skip
        if req.prefill_only and status is None:
            out.held_block_ids = self._hold(req)
            out.seed = req.seed
        elif status is not None:
            self.finish(req.request_id, status)
            out.finish_reason = status.finish_reason
            out.stop_reason = req.stop_reason
        return out

    def _hold(self, req: Request) -> list[int]:
        """Prefill role: the first token is out; keep the prompt's blocks for a peer to read."""
        self.running.remove(req)
        del self.requests[req.request_id]
        req.status = RequestStatus.FINISHED_LENGTH
        return self._release(req, hold=True)

    def _fork(
        self, parent: Request, index: int, token: int, logprobs: dict[int, float] | None
    ) -> SequenceOutput:
        child = parent.fork(index)
        self.kv.fork(parent, child)
        self.requests[child.request_id] = child
        self.groups[parent.group_id].append(child.request_id)
        self.running.append(child)
        return self._append(child, [token], None if logprobs is None else [logprobs])
