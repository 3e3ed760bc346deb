"""The executor's resident LoRA adapters: `max_loras` device slots (model/lora/adapters.py's
LoraSlots), least recently used first out, each adapter read from its PEFT directory
when a step needs it and it is not resident (so an evicted adapter comes back from disk).
The last HOST_COPIES_PER_SLOT x `max_loras` adapters read (at least HOST_COPIES_MIN) stay
in host memory and fill a slot from there: an adapter whose folder changed or went away
after it loaded then still serves, where reading it again failed the whole step (every
request in it, other adapters' and the base's too).

The scheduler never puts more than `max_loras` distinct adapters in one step, so a step's
adapters always fit; the slots of a step's own adapters are never evicted for it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Sequence

import torch

from prelude.config import LoraConfig, ModelConfig
from prelude.model.lora.adapters import LoraAdapter, LoraSlots, read_adapter
from prelude.model.lora.layout import LoraLayout
from prelude.params import LoraRequest

logger = logging.getLogger("prelude.executor.lora")

HOST_COPIES_PER_SLOT = 2
HOST_COPIES_MIN = 4


class AdapterSlots:
    """Which adapter (by LoraRequest.id) sits in which slot, LRU order first to last."""

    def __init__(self, model_config: ModelConfig | LoraLayout, config: LoraConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        """`model_config`: a dense trunk's config, or the model's own LoraLayout (a hybrid's)."""
        self.model_config = model_config
        self.config = config
        self.slots = LoraSlots(model_config, config.max_loras, config.max_lora_rank, dtype, device)
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self.num_loads = 0  # adapters put into a slot (tests, metrics)
        self._labels: dict[int, tuple[str, ...]] = {}  # adapter id -> its head's labels (() without a head)
        # adapter id -> its checked tensors, least recently read or used first; read() runs on
        # whichever thread loads an adapter, slots_for on the engine's: hence the lock
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()
        self._host_max = max(HOST_COPIES_MIN, HOST_COPIES_PER_SLOT * config.max_loras)
        self._host_lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def read(self, lora: LoraRequest) -> LoraAdapter:
        """Read and check an adapter against the base (raises LoraError): what loading one
        checks before any request may use it."""
        adapter = read_adapter(lora.name, lora.path, self.model_config, self.config.max_lora_rank)
        self._labels[lora.id] = adapter.labels
        with self._host_lock:
            self._host[lora.id] = adapter
            self._host.move_to_end(lora.id)
            while len(self._host) > self._host_max:
                self._host.popitem(last=False)
        return adapter

    def _adapter(self, lora: LoraRequest) -> LoraAdapter:
        """The adapter's tensors: its host copy, else read from its folder again."""
        with self._host_lock:
            adapter = self._host.get(lora.id)
            if adapter is not None:
                self._host.move_to_end(lora.id)
                return adapter
        return self.read(lora)

    def labels(self, lora: LoraRequest) -> tuple[str, ...]:
        """The labels of the adapter's own classification head (modules_to_save), or ()."""
        if lora.id not in self._labels:
            self.read(lora)
        return self._labels[lora.id]

    def head(self, lora: LoraRequest) -> torch.Tensor | None:
        """A resident adapter's classification head (None: it has none, the base's serves)."""
        slot = self._resident.get(lora.id)
        return None if slot is None else self.slots.heads[slot]

    def resident(self) -> list[int]:
        return list(self._resident)

    def slots_for(self, loras: Sequence[LoraRequest | None]) -> list[int]:
        """Each row's slot (-1: the base), loading the adapters that are not resident."""
        needed = {lora.id: lora for lora in loras if lora is not None}
        if len(needed) > self.slots.num_slots:
            raise ValueError(f"{len(needed)} adapters in one step; --max-loras is {self.slots.num_slots}")
        for lora_id in needed:
            if lora_id in self._resident:
                self._resident.move_to_end(lora_id)
        for lora_id, lora in needed.items():
            if lora_id not in self._resident:
                self._resident[lora_id] = self._free_slot(needed)
                try:
                    self.slots.load(self._resident[lora_id], self._adapter(lora))
                except Exception:
                    del self._resident[lora_id]
                    raise
                self.num_loads += 1
                logger.info("LoRA adapter %r loaded into slot %d", lora.name, self._resident[lora_id])
        return [-1 if lora is None else self._resident[lora.id] for lora in loras]

    def _free_slot(self, needed: dict[int, LoraRequest]) -> int:
        used = set(self._resident.values())
        for slot in range(self.slots.num_slots):
            if slot not in used:
                return slot
        victim = next(i for i in self._resident if i not in needed)  # LRU first
        return self._resident.pop(victim)

    def evict(self, lora_id: int) -> None:
        """Forget an unloaded adapter's slot (it is overwritten by the next load)."""
        self._resident.pop(lora_id, None)
