"""The load generators' HTTP client, one choice for every peer of a run: "raw" (bench/raw_http.py,
the default) or "httpx". On a 2-core machine httpx's CPU a request, several times the raw
client's, is taken from whichever server is measured."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prelude.bench.loadgen import Sender, completion_sender, json_sender
from prelude.bench.raw_http import RawPool, raw_completion_sender, raw_json_sender

CLIENT_KINDS = ("raw", "httpx")


@dataclass(frozen=True)
class LoadClient:
    kind: str = "raw"

    def __post_init__(self) -> None:
        if self.kind not in CLIENT_KINDS:
            raise ValueError(f"client {self.kind!r}: one of {', '.join(CLIENT_KINDS)}")

    def completions(self, base: str, model: str | None, max_tokens: int) -> Sender:
        """Streamed /v1/completions of a text prompt (loadgen.completion_sender's figures)."""
        if self.kind == "raw":
            return raw_completion_sender(model, max_tokens)
        return completion_sender(base, model, max_tokens)

    def json(self, base: str, path: str, body_of: Callable[[Any], dict[str, Any]],
             items_of: Callable[[Any], int]) -> Sender:
        """A non-streaming JSON POST (loadgen.json_sender's figures)."""
        if self.kind == "raw":
            return raw_json_sender(path, body_of, items_of)
        return json_sender(base, path, body_of, items_of)

    def pool(self, base: str) -> RawPool | None:
        """What run_load's senders take: a RawPool, or None for run_load's own httpx client."""
        return RawPool(base) if self.kind == "raw" else None
