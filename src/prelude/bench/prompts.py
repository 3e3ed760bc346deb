"""Synthetic benchmark prompts of an exact token length under the served model's tokenizer.

Prompts travel as text (every peer tokenizes for itself), so a prompt counts only if
re-encoding the text gives exactly the asked length; candidates that do not are redrawn.
"""

from __future__ import annotations

import random
from typing import Protocol

_WORDS = (
    "alpha beta gamma delta policy judge score rubric model token cache queue latency throughput evidence "
    "answer question context document relevant helpful careful review summary report ticket billing refund "
    "customer order shipping account password error timeout server client request response"
).split()  # noqa: SIM905 (one readable string)


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def count_tokens(tokenizer: TextTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def exact_prompt(tokens: int, rng: random.Random, tokenizer: TextTokenizer, max_tries: int = 50) -> str:
    """Random word text that encodes to exactly `tokens` tokens (no special tokens)."""
    if tokens < 1:
        raise ValueError("tokens must be >= 1")
    for _ in range(max_tries):
        text = " ".join(rng.choice(_WORDS) for _ in range(tokens + 8))
        ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
        # Cutting the ids can leave a boundary that re-encodes differently: check.
        candidate = tokenizer.decode(ids).strip()
        if count_tokens(tokenizer, candidate) == tokens:
            return candidate
    raise RuntimeError(f"could not build a {tokens}-token prompt in {max_tries} tries")


def shared_prefix_prompts(
    prefix_tokens: int, suffix_range: tuple[int, int], count: int, rng: random.Random, tokenizer: TextTokenizer
) -> tuple[list[str], list[int]]:
    """`count` prompts = one shared system prompt of `prefix_tokens` tokens + a unique tail
    of a uniform length in `suffix_range` (inclusive). Returns (prompts, their lengths).

    The prefix ends with a newline so its tokens are the same in every joint prompt; each
    whole prompt is checked to encode to exactly prefix + tail tokens."""
    # The newline is one token of the prefix's budget.
    system = exact_prompt(prefix_tokens - 1, rng, tokenizer) + "\n"
    if count_tokens(tokenizer, system) != prefix_tokens:
        raise RuntimeError("the shared prefix does not keep its length with a trailing newline")
    prompts: list[str] = []
    lengths: list[int] = []
    while len(prompts) < count:
        n = rng.randint(*suffix_range)
        prompt = system + exact_prompt(n, rng, tokenizer)
        if count_tokens(tokenizer, prompt) == prefix_tokens + n:
            prompts.append(prompt)
            lengths.append(prefix_tokens + n)
    return prompts, lengths
