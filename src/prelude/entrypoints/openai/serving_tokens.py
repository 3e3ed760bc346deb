"""POST /tokenize and POST /detokenize (vLLM's shapes), with the model's own tokenizer."""

from __future__ import annotations

from typing import Any

from prelude.engine.client import EngineClient
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from prelude.entrypoints.openai.serving_chat import render_chat


def tokenize(engine: EngineClient, req: TokenizeRequest) -> dict[str, Any]:
    """Token ids of a prompt, or of messages rendered exactly as /v1/chat/completions would."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt or messages")
    if req.messages is not None:
        tokens = render_chat(engine, req.messages, req.add_generation_prompt, req.continue_final_message,
                             req.chat_template_kwargs)
    else:
        tokens = engine.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}


def detokenize(engine: EngineClient, req: DetokenizeRequest) -> dict[str, str]:
    """Text of token ids, special tokens included (the inverse of /tokenize)."""
    vocab = engine.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"token id {bad} is out of vocabulary (size {vocab})", param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}
