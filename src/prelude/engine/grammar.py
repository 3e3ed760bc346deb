"""Structured outputs with llguidance: request constraints -> grammars -> per-request
matchers that give each step's allowed-token bitmask and follow the sampled tokens.

Why llguidance: no torch dependency (a 3 MB wheel, numpy bitmasks), no per-schema
compilation before the first mask (its lexer is lazy: a JSON schema's first mask comes
in well under a millisecond here), and masks computed in Rust with the GIL released.

A grammar is compiled on the caller's thread at validation (a bad schema is a 400 before
the request reaches the engine); the engine thread only asks for masks and commits
tokens. When a constraint is complete its mask allows only end-of-sequence tokens.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from prelude.engine.client import InvalidRequestError
from prelude.params import StructuredOutput
from prelude.tokenizer.base import Tokenizer


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a constraint; raises InvalidRequestError if it cannot be built."""
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        # Compact JSON: free whitespace would let a model pad forever (a schema's own
        # "x-guidance" options still apply on top of these defaults).
        if spec.kind == "json":
            return matcher.grammar_from_json_schema(spec.spec, defaults={"whitespace_flexible": False})
        if spec.kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings")
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        from llguidance.gbnf_to_lark import any_to_lark

        return matcher.grammar_from_lark(any_to_lark(spec.spec))
    except InvalidRequestError:
        raise
    except Exception as exc:  # llguidance raises ValueError/RuntimeError on malformed input
        raise InvalidRequestError(f"invalid {spec.kind} constraint: {exc}") from None


class _TokenTable:
    """llguidance's tokenizer protocol over any Prelude tokenizer with per-token bytes."""

    def __init__(self, tok: Any, vocab_size: int, eos: list[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = tok.bos_token_id
        size = min(vocab_size, tok.vocab_size)
        self.tokens = [tok.token_bytes(i) for i in range(size)] + [b""] * (vocab_size - size)
        # Special tokens decode to nothing when specials are skipped.
        self.special_token_ids = [i for i in range(size) if self.tokens[i]
                                  and tok.decode([i], skip_special_tokens=True) == ""]
        self._tok = tok

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return list(self._tok.encode(s, add_special_tokens=False))


class GrammarMatcher:
    """One request's constraint state: the next-token bitmask, then the sampled token."""

    def __init__(self, matcher: Any, vocab_size: int, eos_ids: list[int]) -> None:
        self._m = matcher
        self._words = (vocab_size + 31) // 32
        self._eos_only = np.zeros(self._words, dtype=np.int32)
        for t in eos_ids:
            self._eos_only[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def bitmask(self) -> np.ndarray:
        """Tokens allowed next ([words] int32); only end-of-sequence once the constraint is
        complete, or if the matcher failed (the request then ends instead of derailing)."""
        if self._m.is_error() or self._m.is_stopped():
            return self._eos_only
        mask = np.zeros(self._words, dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return mask

    def accept(self, token_id: int) -> None:
        if not self._m.is_stopped():
            self._m.consume_token(token_id)

    @property
    def is_error(self) -> bool:
        return bool(self._m.is_error())

    @property
    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())


class GrammarCompiler:
    """Builds matchers for one tokenizer; the llguidance tokenizer is made once, on the
    first constrained request (about a second for a 49K vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._ll: Any = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        import llguidance

        with self._lock:
            if self._ll is None:
                if not self._eos:
                    raise InvalidRequestError("structured outputs need a model with an end-of-sequence token")
                backend = getattr(self._tokenizer, "backend", None)
                if backend is not None:  # an HF `tokenizers` tokenizer: its JSON describes it
                    self._ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos)
                elif hasattr(self._tokenizer, "token_bytes"):
                    from llguidance._tokenizer import TokenizerWrapper

                    table = _TokenTable(self._tokenizer, self._vocab_size, self._eos)
                    self._ll = llguidance.LLTokenizer(TokenizerWrapper(table), n_vocab=self._vocab_size,
                                                      eos_token=self._eos)
                else:
                    raise InvalidRequestError("structured outputs are not available with this tokenizer")
            return self._ll

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """Compile `spec` (InvalidRequestError -> HTTP 400 if it is malformed)."""
        import llguidance

        grammar = grammar_text(spec)
        tok = self._ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {error.splitlines()[0] if error else ''}")
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {m.get_error()}")
        # The first mask (kept for the first step): where no token and no end can
        # start the text (a regex like [^\s\S]), the request would end at once with "".
        m.compute_bitmask()
        if m.is_error():
            raise InvalidRequestError(f"invalid {spec.kind} constraint: it matches no text")
        return GrammarMatcher(m, self._vocab_size, self._eos)
