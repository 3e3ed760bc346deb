"""The prompt templates token rerankers were trained with, as their model cards give them:
what /v1/score and /v1/rerank send for a (query, document) pair when the checkpoint names
one (model/loading/token_scorer.py). `instruction`: the request's task text (each
template has the card's default)."""

from __future__ import annotations

from typing import Callable

from prelude.tokenizer.base import Tokenizer

# Qwen3-Reranker: a system turn fixing the answer to yes/no, the instruction, query and
# document in the user turn, an empty thinking block to answer after.
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# bge-reranker-v2-gemma: "A: query", "B: passage" and the question, each tokenized on its
# own and joined by a newline's tokens, after BOS.
BGE_GEMMA_PROMPT = ("Given a query A and a passage B, determine whether the passage contains an answer to the query "
                    "by providing a prediction of either 'Yes' or 'No'.")


def qwen3_reranker(tokenizer: Tokenizer, query: str, document: str, instruction: str | None) -> list[int]:
    text = (f"{QWEN3_PREFIX}<Instruct>: {instruction or QWEN3_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
            f"{QWEN3_SUFFIX}")
    return tokenizer.encode(text, add_special_tokens=False)


def bge_reranker_gemma(tokenizer: Tokenizer, query: str, document: str, instruction: str | None) -> list[int]:
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    sep = enc("\n")
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return bos + enc(f"A: {query}") + sep + enc(f"B: {document}") + sep + enc(instruction or BGE_GEMMA_PROMPT)


TEMPLATES: dict[str, Callable[[Tokenizer, str, str, str | None], list[int]]] = {
    "qwen3_reranker": qwen3_reranker, "bge_reranker_gemma": bge_reranker_gemma}
