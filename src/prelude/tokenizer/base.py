"""The tokenizer surface the engine and the server rely on."""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class Tokenizer(Protocol):
    """What every tokenizer backend (HF `tokenizers`, fasttoken) offers the engine."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation (the model's eos plus e.g. <|im_end|> for chat models)."""
        ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """Display text of one token (its decoded bytes, lossy for partial UTF-8), for logprobs."""
        ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages with the model's chat template; raises ValueError if it has none."""
        ...
