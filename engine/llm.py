"""The offline API: ``LLM(model).generate(prompts, params)`` and ``LLM(model).chat(messages, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from engine.bad_words import bad_words_token_ids
from engine.chat_format import template_message
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCore, EngineStats
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """An engine plus a tokenizer, for batch generation in one process.

    ``engine_args`` are ``EngineConfig`` fields: block_size, num_blocks, max_num_batched_tokens,
    max_num_seqs, enable_prefix_caching, swap_space, dtype, seed, scheduling_policy, ...
    """

    def __init__(self, model: str, tokenizer: str | None = None, **engine_args) -> None:
        self.core = EngineCore(EngineConfig(model=model, tokenizer=tokenizer, **engine_args))
        self.tokenizer = _load_tokenizer(tokenizer or str(self.core.model_path))
        self._ids = itertools.count()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def close(self) -> None:
        """Remove what the engine keeps outside memory (the disk tier's file); also done at exit."""
        self.core.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priorities: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
        desc: str = "generate",
    ) -> list[RequestOutput]:
        """``sampling_params`` (vLLM's name): one for every prompt, or one per prompt. ``lora``: the
        adapter every prompt runs, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = SamplingParams() if sampling_params is None else sampling_params
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        plist = [self._resolve_bad_words(p) for p in plist]
        token_lists = [self._tokenize(p) for p in prompts]
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} adapters for {len(prompts)} prompts")
        plist = [p if name is None else dataclasses.replace(p, lora=name) for p, name in zip(plist, loras)]
        ranks = self._priorities(priorities, len(prompts))
        for toks, p in zip(token_lists, plist):
            self.core.validate(toks, p)  # all or nothing: refuse before anything is queued
        results: dict[str, RequestOutput] = {}
        detoks: dict[tuple[str, int], IncrementalDetokenizer] = {}
        bar = tqdm(total=len(prompts), desc=desc, unit="req", disable=not use_tqdm)
        start, generated, done = time.perf_counter(), 0, 0
        try:  # NOTE: from the first add on: whatever ends this call aborts what it queued
            for prompt, toks, p, rank in zip(prompts, token_lists, plist, ranks):
                rid = f"offline-{next(self._ids)}"
                results[rid] = RequestOutput(
                    rid,
                    prompt if isinstance(prompt, str) else None,
                    toks,
                    [
                        CompletionOutput(j, logprobs=[] if p.logprobs is not None else None)
                        for j in range(p.n)
                    ],
                )
                if self.tokenizer is not None:
                    for j in range(p.n):
                        detoks[(rid, j)] = IncrementalDetokenizer(self.tokenizer, toks, p)
                self.core.add_request(rid, toks, p, priority=rank)
            while self.core.has_unfinished():
                for out in self.core.step():
                    result = results[out.request_id]
                    if result.outputs[out.sample_index].finish_reason is not None:
                        # Ended by a stop string in an earlier output of this call: overlapped, a step
                        # can return a sequence's token in flight and the next one together.
                        continue
                    stop = self._apply(result, out, detoks.get((out.request_id, out.sample_index)))
                    generated += len(out.new_token_ids)
                    if stop is not None:
                        stopped = self.core.stop_sequence(out.request_id, out.sample_index, stop)
                        # (None: the scheduler ended it already, in an output of this call still to come)
                        ended = SequenceOutput(
                            out.request_id, out.sample_index, [], finish_reason="stop", stop_reason=stop
                        )
                        self._apply(result, stopped or ended, None)
                finished = sum(r.finished for r in results.values())
                if finished != done:
                    bar.update(finished - done)
                    done = finished
                    bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.0f}")
        finally:
            bar.close()
            for rid, r in results.items():
                if not r.finished:
                    self.core.abort_request(rid)
        return list(results.values())

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a
        list of them, each rendered by the tokenizer's chat template (or ``chat_template``) into a
        prompt as ``/v1/chat/completions`` renders it, then generated as ``generate`` does (each
        output's ``prompt`` is the rendered text). ``continue_final_message``: the last (assistant)
        message is continued, not closed, and no generation prompt is added."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat needs the model's tokenizer; this model has none: use generate()")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError(
                "this model's tokenizer has no chat template: pass chat_template= or use generate()"
            )
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # as vLLM: continuing the last message adds no new turn
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        if not conversations or not all(isinstance(c, Sequence) and c for c in conversations):
            raise ValueError(
                "messages must be a conversation (a non-empty list of messages) or a list of them"
            )
        texts = []
        for conv in conversations:
            messages = [template_message(m) for m in conv]  # as /v1/chat/completions gives them
            try:
                texts.append(
                    tok.apply_chat_template(
                        messages,
                        tools=tools,
                        chat_template=chat_template,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        tokenize=False,
                        **(chat_template_kwargs or {}),
                    )
                )
            except Exception as exc:  # the template's own refusal (roles must alternate, ...)
                raise ValueError(f"chat template failed: {exc}") from exc
        prompts = [list(tok.encode(text, add_special_tokens=False)) for text in texts]
        outputs = self.generate(prompts, sampling_params, lora=lora, use_tqdm=use_tqdm, desc="chat")
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _priorities(self, priorities: Sequence[int] | None, n: int) -> list[int]:
        """One integer per prompt, for an engine that schedules by priority; a ValueError otherwise."""
        if priorities is None:
            return [0] * n
        policy = self.core.config.scheduling_policy
        if policy != "priority":
            raise ValueError(f"priorities need scheduling_policy='priority' (this engine's is {policy!r})")
        ranks = list(priorities)
        if len(ranks) != n or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ValueError(f"priorities must be {n} integers, one per prompt, got {priorities!r}")
        return ranks

    def _resolve_bad_words(self, p: SamplingParams) -> SamplingParams:
        """``bad_words`` as token ids, added to any ``bad_words_token_ids`` given beside them."""
        if not p.bad_words:
            return p
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none: pass bad_words_token_ids")
        words = [
            w for w in bad_words_token_ids(self.tokenizer, p.bad_words) if w not in p.bad_words_token_ids
        ]
        return dataclasses.replace(p, bad_words_token_ids=[*p.bad_words_token_ids, *words])

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token-id lists")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return prompt

    @staticmethod
    def _apply(
        result: RequestOutput, out: SequenceOutput, detok: IncrementalDetokenizer | None
    ) -> str | None:
        comp = result.outputs[out.sample_index]
        if out.prompt_logprobs is not None:
            result.prompt_logprobs = out.prompt_logprobs
        new = out.new_token_ids
        stop = None
        if detok is not None and new:
            stop = detok.add(new)
            comp.text = detok.text
            new = new[: detok.kept]  # a stop string ended the output inside a speculated run
        comp.token_ids.extend(new)
        if out.new_logprobs and comp.logprobs is not None:
            comp.logprobs.extend(out.new_logprobs[: len(new)])
        # (an output the call made itself, a stop string's end, carries no count: never lowered)
        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
        if out.finish_reason is None:
            return stop
        if out.finish_reason == "error":
            comp.error = out.error or "the engine failed this request"
            logger.warning("request %s failed in the engine: %s", result.request_id, comp.error)
        if stop is None:
            if detok is not None:
                detok.flush()  # bytes of a character the output ended inside
                comp.text = detok.text
            comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
        else:  # its last token completed a stop string: the output ended there, as the ingress says
            comp.finish_reason, comp.stop_reason = "stop", stop
        return None


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer at %s (%s): token-id prompts only, no text output", name, exc)
        return None
