"""The LoRA adapters a server serves by name: a request's `model` picks one (or the base).

Loaded at start (`--lora-modules NAME=PATH`) or at run time (`POST /v1/load_lora_adapter
{lora_name, lora_path}`), unloaded with `POST /v1/unload_lora_adapter {lora_name}`. A load
reads and checks the adapter against the base (off the event loop) before the name is
served, so a bad adapter gets a 400 saying why and nothing changes. Each load gets a new
id: requests already running keep the adapter they started with (their rows carry it), and
K/V cached under an unloaded adapter is never found by a later load of the same name.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from pydantic import ConfigDict

from prelude.engine.request import LoraRequest
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.protocol import RequestBody


class LoadLoraAdapterRequest(RequestBody):  # RequestBody: a name with a lone surrogate is a 400
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's shape carries it; names are unique here


class ServedAdapters:
    """Adapter name -> LoraRequest, for one engine (the event loop's only)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._by_name: dict[str, LoraRequest] = {}
        self._labels: dict[str, tuple[str, ...]] = {}  # an adapter's own classification head's labels
        self._ids = itertools.count(1)
        self._loading: set[str] = set()

    def resolve(self, name: str | None) -> LoraRequest | None:
        """The adapter a request's `model` names; None for the base (or no name). An
        unknown name is a 404 with an OpenAI error body."""
        if name is None or name == self._engine.model_name:
            return None
        lora = self._by_name.get(name)
        if lora is None:
            served = ", ".join([self._engine.model_name, *self._by_name])
            raise APIError(f"The model `{name}` does not exist. This server serves: {served}.", 404,
                           param="model", code="model_not_found")
        return lora

    def _check_name(self, name: str) -> None:
        if not name:
            raise APIError("lora_name must not be empty", 400, param="lora_name", code="invalid_lora_adapter")
        if name == self._engine.model_name or name in self._by_name or name in self._loading:
            raise APIError(f"an adapter (or model) named `{name}` is already loaded", 400, param="lora_name",
                           code="invalid_lora_adapter")

    async def load(self, name: str, path: str) -> LoraRequest:
        self._check_name(name)
        check = getattr(self._engine, "check_adapter", None)
        if check is None:
            raise APIError("this server's engine does not serve LoRA adapters", 400, code="invalid_lora_adapter")
        lora = LoraRequest(name, path, next(self._ids))
        self._loading.add(name)  # a second load of the name while this one reads is refused
        try:
            labels = await check(lora)
        except ValueError as e:  # model.lora.LoraError, or an engine without slots
            raise APIError(f"cannot load LoRA adapter `{name}`: {e}", 400, param="lora_path",
                           code="invalid_lora_adapter") from None
        finally:
            self._loading.discard(name)
        self._by_name[name] = lora
        self._labels[name] = tuple(labels or ())
        return lora

    def labels(self, lora: LoraRequest) -> tuple[str, ...]:
        """The labels /classify and /v1/score answer with under this adapter: its own
        head's (modules_to_save), else the base model's."""
        return self._labels.get(lora.name) or self._engine.labels

    def load_at_start(self, name: str, path: str) -> LoraRequest:
        """`--lora-modules`: the same checks, before the server listens (raises APIError)."""
        return asyncio.run(self.load(name, path))

    def unload(self, name: str) -> None:
        self._labels.pop(name, None)
        if self._by_name.pop(name, None) is None:
            raise APIError(f"no LoRA adapter named `{name}` is loaded", 404, param="lora_name",
                           code="lora_adapter_not_found")

    def models(self) -> list[LoraRequest]:
        return list(self._by_name.values())
