"""A minimal EngineClient that serves no model: enough for routes that need no engine."""

from __future__ import annotations

from typing import AsyncIterator

from prelude.engine.request import RequestOutput, SamplingParams

from tests.engine.tiny import ByteTokenizer


class StaticEngine:
    model_name = "static"
    max_model_len = 64
    tokenizer = ByteTokenizer()

    def is_healthy(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {"kv_blocks_total": 1}

    def request_metrics(self) -> list:
        return []

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        return None

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def abort(self, request_id: str) -> None:
        return None
