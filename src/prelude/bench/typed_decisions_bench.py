"""`prelude bench decisions --typed-only`: typed decisions (/v1/decisions) against the ways a
client would get the same answers from the same server without them.

The workload: 16 questions (6 predicates, 5 choices of 3-4 options, 5 scores of 5 levels)
about one fresh input of `--input-tokens` tokens, per request.
- `decisions`: one /v1/decisions request with the 16 questions (one forward: the input
  once, each question an item after it);
- `chat`: 16 concurrent one-token /v1/chat/completions with logprobs, each asking one
  question in the same words as a further user turn after the same input (the prefix cache
  shares the input between them);
- `classify`: one /classify of the same input (yes/no, chat template): one question's cost.
Concurrency 1 (modes alternate input by input; medians) and a closed-loop stream of inputs
at `--concurrency` (p50 latency per request). Prints a table and writes JSON.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import httpx

from prelude.bench.prompts import exact_prompt
from prelude.entrypoints.openai.decision_prompts import question_text
from prelude.entrypoints.openai.decision_protocol import decision_questions

MODES = ("decisions", "chat", "classify")


def sixteen_questions() -> list[dict[str, Any]]:
    levels = [{"label": label} for label in ("none", "low", "medium", "high", "critical")]
    qs: list[dict[str, Any]] = [{"type": "predicate", "instructions": f"The text mentions {topic}."}
                                for topic in ("billing", "a refund", "an error", "a password", "shipping", "a judge")]
    qs += [{"type": "choice", "instructions": instr, "choices": [{"value": v} for v in values]} for instr, values in (
        ("Which team should handle it?", ("billing", "technical", "shipping", "other")),
        ("What is the tone?", ("calm", "annoyed", "angry")),
        ("Which language is it in?", ("English", "French", "other")),
        ("Who wrote it?", ("customer", "agent", "bot", "unknown")),
        ("Is it a question?", (True, False, "unclear")))]
    qs += [{"type": "score", "instructions": f"How {what} is it?", "levels": levels}
           for what in ("urgent", "long", "polite", "technical", "clear")]
    return qs


class TypedWorkload:
    def __init__(self, seed: int, input_tokens: int) -> None:
        from prelude.model.loader import load_model_files

        self.tok = load_model_files(None).tokenizer
        self.rng = random.Random(seed)
        self.input_tokens = input_tokens
        self.questions = sixteen_questions()
        self.texts = [question_text(q) for q in decision_questions(self.questions)]  # the chat mode's turns

    def fresh_input(self) -> str:
        return exact_prompt(self.input_tokens, self.rng, self.tok)


async def _ask(client: httpx.AsyncClient, base: str, work: TypedWorkload, text: str, mode: str) -> None:
    if mode == "decisions":
        r = await client.post(base + "/v1/decisions", json={"input": text, "questions": work.questions})
        r.raise_for_status()
        assert len(r.json()["answers"]) == len(work.questions)
    elif mode == "chat":
        async def one(question: str) -> None:
            body = {"messages": [{"role": "user", "content": text}, {"role": "user", "content": question}],
                    "max_tokens": 1, "logprobs": True, "top_logprobs": 20, "temperature": 0}
            r = await client.post(base + "/v1/chat/completions", json=body)
            r.raise_for_status()

        await asyncio.gather(*(one(q) for q in work.texts))
    else:
        r = await client.post(base + "/classify", json={"input": [text], "labels": ["Yes", "No"],
                                                        "use_chat_template": True})
        r.raise_for_status()


async def typed_c1(base: str, work: TypedWorkload, iters: int) -> dict[str, list[float]]:
    """Seconds per input at concurrency 1, the modes alternating input by input."""
    out: dict[str, list[float]] = {m: [] for m in MODES}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        for i in range(iters + 1):  # the first round warms up
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                text = work.fresh_input()
                t0 = time.perf_counter()
                await _ask(client, base, work, text, mode)
                if i > 0:
                    out[mode].append(time.perf_counter() - t0)
    return out


async def typed_stream(base: str, work: TypedWorkload, modes: tuple[str, ...], concurrency: int,
                       inputs: int) -> dict[str, dict[str, float]]:
    """A closed-loop stream of fresh inputs at `concurrency`, one mode at a time: each
    request's latency (p50) and inputs/s."""
    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency * 20)) as client:
        for mode in modes:
            texts = [work.fresh_input() for _ in range(inputs)]
            latencies: list[float] = []

            async def worker() -> None:
                while texts:
                    text = texts.pop()
                    t0 = time.perf_counter()
                    await _ask(client, base, work, text, mode)
                    latencies.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
            out[mode] = {"p50_s": statistics.median(latencies), "inputs_per_s": inputs / wall}
    return out


def run_typed(base: str, seed: int, input_tokens: int, iters: int, concurrency: int, inputs: int) -> dict[str, Any]:
    work = TypedWorkload(seed, input_tokens)
    c1 = asyncio.run(typed_c1(base, work, iters))
    stream = asyncio.run(typed_stream(base, work, ("decisions", "classify"), concurrency, inputs))
    med = {m: statistics.median(v) for m, v in c1.items()}
    result = {
        "workload": {"input_tokens": input_tokens, "questions": len(work.questions), "concurrency": concurrency,
                     "stream_inputs": inputs},
        "c1_s_per_input_p50": med, "c1_samples_s": c1, "stream": stream,
        "goals": {
            "decisions_over_chat_c1": med["chat"] / med["decisions"],
            "decisions_p50_over_classify_p50_stream": stream["decisions"]["p50_s"] / stream["classify"]["p50_s"],
        },
    }
    g = result["goals"]
    print(f"typed decisions: 16 questions about a {input_tokens}-token input")
    for mode in MODES:
        print(f"  c=1 {mode:<10}{1000 * med[mode]:>10.1f} ms per input")
    for mode, s in stream.items():
        print(f"  c={concurrency} {mode:<10}{1000 * s['p50_s']:>10.1f} ms p50 {s['inputs_per_s']:>8.2f} inputs/s")
    print(f"  goals: decisions vs 16 one-token chat calls at c=1 = {g['decisions_over_chat_c1']:.2f}x (>= 1.5); "
          f"c={concurrency} p50 decisions / classify = {g['decisions_p50_over_classify_p50_stream']:.2f}x (<= 2)")
    return result
