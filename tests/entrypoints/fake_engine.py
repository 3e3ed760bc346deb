"""A model-free EngineClient for HTTP tests: a character tokenizer and an engine that
"generates" the prompt reversed, deterministically, and records what happened to
every request (finished, closed early, failed, aborted)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from prelude.engine.client import InvalidRequestError
from prelude.engine.metrics import RequestMetrics
from prelude.engine.request import ExecClass, FinishReason, PoolingParams, RequestOutput, SamplingParams, TokenLogprob
from prelude.engine.validation import pick_exec_class

BOS, EOS = 1, 2
_OFFSET = 16  # character c is token ord(c) + 16; ids below are special
_SPECIAL_TEXT = {BOS: "<s>", EOS: "</s>"}

# Prompt markers that make the fake engine misbehave on purpose.
FAIL_ADMISSION = "FAIL_ADMISSION"  # InvalidRequestError from generate(), after validate() passed
FAIL_ENGINE = "FAIL_ENGINE"  # RuntimeError after the first token
TEMPLATE_ERROR = "TEMPLATE_ERROR"  # the chat template raises


class CharTokenizer:
    """One token per character; BOS is added by encode(add_special_tokens=True)."""

    vocab_size = 0x110000 + _OFFSET
    bos_token_id = BOS
    eos_token_ids = frozenset({EOS})
    chat_template = "<|role|>content<|end|> ... <|assistant|>"

    def __init__(self) -> None:
        self.last_template_kwargs: dict[str, Any] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) + _OFFSET for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            "" if i < _OFFSET and skip_special_tokens else self.token_text(i) for i in ids
        )

    def token_text(self, token_id: int) -> str:
        if token_id < _OFFSET:
            return _SPECIAL_TEXT.get(token_id, f"<special_{token_id}>")
        return chr(token_id - _OFFSET)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        self.last_template_kwargs = kwargs
        upper = bool(kwargs.get("upper"))
        parts = []
        for m in messages:
            if TEMPLATE_ERROR in m["content"]:
                raise RuntimeError("template refused the conversation")
            content = m["content"].upper() if upper else m["content"]
            parts.append(f"<|{m['role']}|>{content}<|end|>")
        return "".join(parts) + ("<|assistant|>" if add_generation_prompt else "")


def char_token(c: str) -> int:
    return ord(c) + _OFFSET


@dataclass
class Plan:
    """The whole deterministic output of one request, computed up front."""

    tokens: list[int]
    texts: list[str]  # text each token contributes (stop strings already cut)
    finish_reason: FinishReason
    stop_reason: str | int | None


def _source(prompt_ids: list[int], seed: int | None) -> list[int]:
    """The prompt's characters reversed, rotated by the seed (so seeded choices differ)."""
    chars = [t for t in reversed(prompt_ids) if t >= _OFFSET] or [char_token("x")]
    shift = (seed or 0) % len(chars)
    return chars[shift:] + chars[:shift]


def plan_output(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> Plan:
    """Reversed prompt, cycled, up to max_tokens; EOS after one full pass unless
    ignore_eos; stop token ids and stop strings end it like a real engine would."""
    budget = params.max_tokens if params.max_tokens is not None else max_model_len - len(prompt_ids)
    source = _source(prompt_ids, params.seed)
    tokens: list[int] = []
    text = ""
    for step in range(budget):
        token = EOS if step == len(source) and not params.ignore_eos else source[step % len(source)]
        tokens.append(token)
        if token in params.stop_token_ids:
            return _cut(tokens, text, len(text), FinishReason.STOP, token)
        if token == EOS:
            return _cut(tokens, text, len(text), FinishReason.STOP, None)
        text += chr(token - _OFFSET)
        for stop in params.stop:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop) if params.include_stop_str_in_output else at
                return _cut(tokens, text, end, FinishReason.STOP, stop)
    return _cut(tokens, text, len(text), FinishReason.LENGTH, None)


def _cut(tokens: list[int], text: str, end: int, reason: FinishReason, stop_reason: str | int | None) -> Plan:
    """Per-token texts whose concatenation is text[:end] (special tokens add none)."""
    texts = []
    chars = 0
    for t in tokens:
        if t < _OFFSET:
            texts.append("")
            continue
        chars += 1
        texts.append(text[chars - 1] if chars <= end else "")
    return Plan(tokens, texts, reason, stop_reason)


def token_logprob(step: int, token: int, k: int) -> TokenLogprob:
    """The sampled token is the best; k alternatives follow it (ids after it)."""
    lp = -0.1 * (step % 5 + 1)
    top = tuple([(token, lp)] + [(token + 1 + j, lp - 1.0 - j) for j in range(k - 1)]) if k > 0 else ()
    return TokenLogprob(token, lp, top)


def prompt_logprobs(prompt_ids: list[int], k: int) -> tuple[TokenLogprob | None, ...]:
    rows = [TokenLogprob(t, -0.5, tuple([(t, -0.5)] + [(t + 1 + j, -1.5 - j) for j in range(k - 1)]) if k else (), 1)
            for t in prompt_ids[1:]]
    return (None, *rows)


@dataclass
class Call:
    """What the engine was asked for one request, and what became of it."""

    prompt_token_ids: list[int]
    params: SamplingParams
    state: str = "running"  # running | finished | closed (stream closed early) | failed


class FakeEngine:
    """EngineClient over CharTokenizer. `token_delay` makes each token take that long."""

    def __init__(self, max_model_len: int = 256, token_delay: float = 0.0, model_name: str = "fake-model") -> None:
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._tokenizer = CharTokenizer()
        self.token_delay = token_delay
        # Set: every request's first token waits until it is set (a test holds requests
        # "waiting to start" for as long as it needs, on any machine).
        self.first_token: asyncio.Event | None = None
        self.healthy = True
        self.calls: dict[str, Call] = {}
        self.aborted: list[str] = []
        self.force_paged = False  # as --force-paged-path: every request is Paged

    # --- EngineClient -------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> CharTokenizer:
        return self._tokenizer

    @property
    def labels(self) -> tuple[str, ...]:
        return ()

    @property
    def can_generate(self) -> bool:
        return True

    @property
    def is_encoder(self) -> bool:
        return False

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None = None
    ) -> None:
        bad = [t for t in prompt_token_ids if not 0 <= t < self._tokenizer.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of vocabulary")
        if len(prompt_token_ids) >= self._max_model_len:
            raise InvalidRequestError(f"a prompt of {len(prompt_token_ids)} tokens leaves no room in the context")
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > self._max_model_len:
            raise InvalidRequestError("prompt plus max_tokens exceeds the context")

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        assert params.n == 1, "the server must fan out n > 1"
        assert request_id not in self.calls, f"request id {request_id} reused"
        self.validate(prompt_token_ids, params)
        prompt_text = self._tokenizer.decode(prompt_token_ids)
        if FAIL_ADMISSION in prompt_text:
            raise InvalidRequestError("admission refused late")
        call = self.calls[request_id] = Call(list(prompt_token_ids), params)
        try:
            async for out in self._outputs(request_id, call, FAIL_ENGINE in prompt_text):
                yield out
            call.state = "finished"
        except GeneratorExit:
            call.state = "closed"
            raise
        except asyncio.CancelledError:
            call.state = "closed"
            raise
        except Exception:
            call.state = "failed"
            raise

    async def _outputs(self, request_id: str, call: Call, fail: bool) -> AsyncIterator[RequestOutput]:
        params, prompt = call.params, call.prompt_token_ids
        plan = plan_output(prompt, params, self._max_model_len)
        k = params.logprobs
        head = prompt_logprobs(prompt, params.prompt_logprobs) if params.prompt_logprobs is not None else None
        budget = params.max_tokens if params.max_tokens is not None else self._max_model_len - len(prompt)
        exec_class = ExecClass.PAGED if self.force_paged else pick_exec_class(params, budget, None)  # as validation would
        if not plan.tokens:  # max_tokens=0: one final, empty increment
            yield RequestOutput(request_id, (), "", (), True, plan.finish_reason, len(prompt), 0,
                                prompt_logprobs=head, exec_class=exec_class)
            return
        for step, (token, text) in enumerate(zip(plan.tokens, plan.texts, strict=True)):
            if step == 0 and self.first_token is not None:
                await self.first_token.wait()
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if fail and step == 1:
                raise RuntimeError("engine exploded")
            last = step == len(plan.tokens) - 1
            yield RequestOutput(
                request_id, (token,), text, (token_logprob(step, token, k),) if k is not None else (), last,
                plan.finish_reason if last else None, len(prompt), step + 1,
                stop_reason=plan.stop_reason if last else None, prompt_logprobs=head if step == 0 else None,
                exec_class=exec_class,
            )

    async def encode(self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams) -> RequestOutput:
        raise InvalidRequestError("this fake model has no pooling head")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def is_healthy(self) -> bool:
        return self.healthy

    def metrics(self) -> dict[str, float]:
        return {"requests_running": float(len(self.running())), "requests_running_paged": float(len(self.running()))}

    def request_metrics(self) -> list[RequestMetrics]:
        return []

    # --- test helpers ---------------------------------------------------------------

    def shutdown(self) -> None:
        """For tests.entrypoints.conftest.running_server, which shuts its engine down."""

    def running(self) -> list[str]:
        return [rid for rid, c in self.calls.items() if c.state == "running"]

    def states(self, prefix: str = "") -> dict[str, str]:
        return {rid: c.state for rid, c in self.calls.items() if rid.startswith(prefix)}


def asgi_client(app: Any) -> "httpx.AsyncClient":
    """An httpx client driving `app` in process; app exceptions become 500s, as in a server."""
    import httpx

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test")
