"""The engine's LoRA calls: a mixin of ``engine.engine_core.EngineCore``.

Adapters are served when the engine starts with ``lora_modules`` or ``enable_lora``: their device
slots (``engine.lora.slots``) are allocated with the model, before the KV cache takes the rest of the
memory. ``add_lora`` / ``remove_lora`` change the served set at run time; a request names its adapter
(``SamplingParams.lora``) and an unknown name is refused there, as is removing an adapter that
unfinished requests use.
"""

from __future__ import annotations

import logging

from engine.lora.adapter import AdapterError, load_adapter
from engine.lora.slots import LoraSlots

logger = logging.getLogger(__name__)


class UnknownAdapterError(ValueError):
    """A request names an adapter the engine does not serve (a ValueError: every role refuses the
    request as it refuses other invalid ones)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"the model {name!r} does not exist (no such LoRA adapter is served)")
        self.name = name


class LoraMixin:
    def _setup_lora(self) -> None:
        """The adapter slots and the adapters to serve from the start (after the model loads)."""
        cfg = self.config
        self.lora_slots = None
        if not (cfg.enable_lora or cfg.lora_modules):
            return
        self.lora_slots = LoraSlots(self.spec, cfg.max_loras, cfg.max_lora_rank, self.device, cfg.dtype)
        logger.info(
            "LoRA: %d device slots of rank <= %d (%.1f MiB)",
            cfg.max_loras,
            cfg.max_lora_rank,
            self.lora_slots.bytes / 2**20,
        )
        for name, path in (cfg.lora_modules or {}).items():
            self._load_lora(name, path)

    def add_lora(self, name: str, path: str, replace: bool = True, check: bool = False) -> None:
        """Serve the PEFT adapter at ``path`` as ``name``; ``AdapterError`` says why one is refused.
        ``replace=False``: refuse a name already served; ``check``: read and check the adapter as a
        load would, serve nothing new."""
        if self.lora_slots is None:
            raise AdapterError("this engine serves no adapters: start it with enable_lora or lora_modules")
        if name in self.lora_slots.adapters:
            if not replace:
                raise AdapterError(f"adapter {name!r} is already loaded")
            if self._lora_in_use(name):
                raise AdapterError(
                    f"adapter {name!r} is in use by unfinished requests; it cannot be replaced now"
                )
        if check:
            _check_name(name)
            load_adapter(name, path, self.spec, self.config.max_lora_rank)
            return
        self._unpin_finished()
        self._load_lora(name, path)

    def _load_lora(self, name: str, path: str) -> None:
        _check_name(name)
        adapter = load_adapter(name, path, self.spec, self.config.max_lora_rank)
        self.lora_slots.add(adapter)
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %d modules)",
            name,
            path,
            adapter.rank,
            len(adapter.modules),
        )

    def remove_lora(self, name: str) -> None:
        if self.lora_slots is None or name not in self.lora_slots.adapters:
            raise UnknownAdapterError(name)
        if used := self._lora_in_use(name):
            raise AdapterError(f"adapter {name!r} is in use by {used} unfinished requests")
        self._unpin_finished()
        self.lora_slots.remove(name)

    def lora_salts(self) -> dict[str, str]:
        """Each served adapter's prefix-cache namespace (appended to ``prefix_salt``): the router
        hashes an adapter's prompts with it, as the engine does."""
        return {n: a.cache_salt for n, a in self.lora_slots.adapters.items()} if self.lora_slots else {}

    def resident_loras(self) -> list[str]:
        """The adapters in device slots now: a request of one runs without a swap-in."""
        return sorted(self.lora_slots.slot_of) if self.lora_slots is not None else []

    def list_loras(self) -> list[str]:
        return sorted(self.lora_slots.adapters) if self.lora_slots is not None else []

    def lora_args(self, name: str | None) -> dict:
        """The Request arguments of adapter ``name`` (None: the base model)."""
        if name is None:
            return {}
        if self.lora_slots is None or name not in self.lora_slots.adapters:
            raise UnknownAdapterError(name)
        return {"lora": name, "lora_salt": self.lora_slots.adapters[name].cache_salt}

    def _unpin_finished(self) -> None:
        """Sequences that finished since the last step still pin their adapters' slots (the runner
        hears of them with the next step, which an idle engine may never run): unpin them now."""
        for seq_id in self.scheduler.finished_not_sent:
            self.runner.unpin_lora(seq_id)

    def _lora_in_use(self, name: str) -> int:
        """Requests of adapter ``name``: queued or running, or staged (their prefix read from disk)."""
        staged = self.prefetch.requests() if self.prefetch is not None else []
        return sum(r.lora == name for r in (*self.scheduler.requests.values(), *staged))


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise AdapterError(f"an adapter needs a non-empty name without surrounding spaces, got {name!r}")
