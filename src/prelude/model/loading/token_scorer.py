"""Rerankers that score with a token (Qwen3-Reranker: P("yes") against "no";
bge-reranker-v2-gemma: the logit of "Yes"), served as the one-output classifiers they
are: the score head is made at load from the LM head's rows of those tokens, as vLLM's
`classifier_from_token` describes them (in config.json or through --hf-overrides).

- `classifier_from_token: [no, yes]`, `method: from_2_way_softmax` (the default for two
  tokens): the head is row(yes) - row(no), whose sigmoid is the softmax of the two
  tokens' logits taken at "yes".
- `method: no_post_processing`: the tokens' rows as they are (one output per token); for
  one token, its logit, whose sigmoid /v1/score and /v1/rerank return.

`is_original_qwen3_reranker: true` (vLLM's name) means `[no, yes]` with the two-way softmax
and the Qwen3-Reranker prompt template; `score_template` names a template for the score
routes (qwen3_reranker, bge_reranker_gemma).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from prelude.model.base import UnsupportedCheckpoint
from prelude.tokenizer.base import Tokenizer

SCORE_TEMPLATES = ("qwen3_reranker", "bge_reranker_gemma")
METHODS = ("from_2_way_softmax", "no_post_processing")


def score_template(raw: Mapping[str, Any]) -> str | None:
    """The prompt template the score routes apply for this checkpoint (None: theirs)."""
    name = raw.get("score_template")
    if name is None and raw.get("is_original_qwen3_reranker"):
        name = "qwen3_reranker"
    if name is not None and name not in SCORE_TEMPLATES:
        raise UnsupportedCheckpoint(f"score_template {name!r} is not known (known: {', '.join(SCORE_TEMPLATES)})")
    return None if name is None else str(name)


def as_token_classifier(raw: dict[str, Any]) -> dict[str, Any]:
    """The config of a checkpoint that scores with tokens, as the *ForSequenceClassification
    with one output per score it becomes (others as they are)."""
    tokens = _tokens(raw)
    if not tokens:
        return raw
    name = str((raw.get("architectures") or [""])[0])
    if not name.endswith(("ForCausalLM", "ForSequenceClassification")):
        raise UnsupportedCheckpoint(f"classifier_from_token needs a causal LM checkpoint, not {name or 'one without architectures'}")
    outputs = 1 if _method(raw, tokens) == "from_2_way_softmax" else len(tokens)
    return {**raw, "architectures": [name.replace("ForCausalLM", "ForSequenceClassification")],
            "num_labels": outputs, "id2label": {str(i): f"LABEL_{i}" for i in range(outputs)}}


def add_score_head(raw: Mapping[str, Any], weights: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    """Put `score.weight` among `weights`, made from the LM head's rows of the tokens (the
    embedding's where the head is tied)."""
    tokens = _tokens(raw)
    if not tokens:
        return
    if "score.weight" in weights:
        raise UnsupportedCheckpoint("classifier_from_token on a checkpoint that has a score head already")
    head = weights.get("lm_head.weight")
    if head is None:
        head = weights.get("model.embed_tokens.weight")
    if head is None:
        raise UnsupportedCheckpoint("classifier_from_token: the checkpoint has no LM head to take token rows from")
    ids = []
    for token in tokens:
        found = tokenizer.encode(token, add_special_tokens=False)
        if len(found) != 1:
            raise UnsupportedCheckpoint(f"classifier_from_token {token!r} is {len(found)} tokens, not one")
        ids.append(found[0])
    rows = head[torch.tensor(ids)].float()
    score = rows[1:2] - rows[0:1] if _method(raw, tokens) == "from_2_way_softmax" else rows
    weights["score.weight"] = score.to(head.dtype)


def _tokens(raw: Mapping[str, Any]) -> list[str]:
    tokens = raw.get("classifier_from_token")
    if tokens is None and raw.get("is_original_qwen3_reranker"):
        tokens = ["no", "yes"]
    return [str(t) for t in tokens or ()]


def _method(raw: Mapping[str, Any], tokens: list[str]) -> str:
    default = "from_2_way_softmax" if len(tokens) == 2 else "no_post_processing"
    method = str(raw.get("method", default))
    if method not in METHODS:
        raise UnsupportedCheckpoint(f"classifier_from_token method {method!r} is not implemented "
                                    f"(implemented: {', '.join(METHODS)})")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise UnsupportedCheckpoint("method from_2_way_softmax needs two classifier tokens (the no and the yes)")
    return method
