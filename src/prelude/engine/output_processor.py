"""Per-request streaming state: detokenize, detect stops, hold back possible stop text."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from prelude.forward_batch import HeadOutput
from prelude.engine.request import FinishReason, Request, RequestOutput, TokenLogprob
from prelude.tokenizer.base import Tokenizer
from prelude.tokenizer.detokenizer import IncrementalDetokenizer


class StreamDetokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass
class OutputStream:
    """Text state of one Paged request: what was produced and what was already sent."""

    detok: StreamDetokenizer
    stops: tuple[str, ...]
    include_stop: bool
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    sent_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_head: HeadOutput | None = None  # prompt logprobs to send with the first increment

    @property
    def holdback(self) -> int:
        # Text that could still grow into a stop string must not be emitted yet.
        return max((len(s) for s in self.stops), default=1) - 1


def new_detokenizer(tokenizer: Tokenizer, req: Request) -> StreamDetokenizer:
    """fasttoken streams from its id -> bytes table; other tokenizers re-decode a window."""
    make = getattr(tokenizer, "new_detokenizer", None)
    if make is not None:
        return make(req.params.skip_special_tokens)  # type: ignore[no-any-return]
    return IncrementalDetokenizer(tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)


def new_stream(tokenizer: Tokenizer, req: Request) -> OutputStream:
    return OutputStream(
        detok=new_detokenizer(tokenizer, req),
        stops=req.params.stop,
        include_stop=req.params.include_stop_str_in_output,
    )


def _find_stop(stream: OutputStream, searched_from: int) -> tuple[int, str] | None:
    start = max(0, searched_from - stream.holdback)
    best: tuple[int, str] | None = None
    for s in stream.stops:
        i = stream.text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def process_token(
    req: Request, stream: OutputStream, token_id: int, logprob: TokenLogprob | None, max_model_len: int
) -> RequestOutput:
    """Append one sampled token to the request, update its finish state, emit an increment."""
    req.output_token_ids.append(token_id)
    if logprob is not None:
        stream.pending_logprobs.append(logprob)
    params = req.params
    finish: FinishReason | None = None
    if token_id in req.eos_token_ids:
        finish = FinishReason.STOP  # the eos token's text is not part of the output
    elif token_id in params.stop_token_ids:
        finish, req.stop_reason = FinishReason.STOP, token_id
    else:
        before = len(stream.text)
        stream.text += stream.detok.push(token_id)
        hit = _find_stop(stream, before) if stream.stops else None
        if hit is not None:
            idx, s = hit
            stream.text = stream.text[: idx + len(s) if stream.include_stop else idx]
            finish, req.stop_reason = FinishReason.STOP, s
    if finish is None and (len(req.output_token_ids) >= req.max_output_tokens or req.num_tokens >= max_model_len):
        finish = FinishReason.LENGTH
        stream.text += stream.detok.flush()
    if finish is not None:
        req.finish_reason = finish
        upto = len(stream.text)
    else:
        upto = max(stream.sent, len(stream.text) - stream.holdback)
    return emit(req, stream, upto, finished=finish is not None)


def emit(req: Request, stream: OutputStream, upto: int, finished: bool) -> RequestOutput:
    """The increment since the last emit: new tokens, text up to `upto`, their logprobs."""
    text = stream.text[stream.sent : upto]
    stream.sent = max(stream.sent, upto)
    new_tokens = tuple(req.output_token_ids[stream.sent_tokens :])
    stream.sent_tokens = len(req.output_token_ids)
    logprobs = tuple(stream.pending_logprobs)
    stream.pending_logprobs.clear()
    head, stream.pending_head = stream.pending_head, None
    return with_head(RequestOutput(
        request_id=req.request_id,
        new_token_ids=new_tokens,
        text=text,
        logprobs=logprobs,
        finished=finished,
        finish_reason=req.finish_reason if finished else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=len(req.output_token_ids),
        stop_reason=req.stop_reason if finished else None,
        exec_class=req.exec_class,
    ), head)


def with_head(out: RequestOutput, head: HeadOutput | None) -> RequestOutput:
    if head is None:
        return out
    return replace(
        out,
        prompt_logprobs=tuple(head.prompt_logprobs) if head.prompt_logprobs is not None else None,
        embedding=tuple(head.embedding) if head.embedding is not None else None,
        scores=tuple(head.scores) if head.scores is not None else None,
    )


def oneshot_output(
    req: Request, tokenizer: Tokenizer, token_id: int | None, logprob: TokenLogprob | None, head: HeadOutput | None
) -> RequestOutput:
    """The single, final output of a OneShot request: no stream, no detokenizer state."""
    text = ""
    finish = FinishReason.LENGTH
    if token_id is not None:
        req.output_token_ids.append(token_id)
        if token_id in req.eos_token_ids:
            finish = FinishReason.STOP
        elif token_id in req.params.stop_token_ids:
            finish, req.stop_reason = FinishReason.STOP, token_id
        else:
            text = tokenizer.decode([token_id], req.params.skip_special_tokens)
            for s in req.params.stop:
                i = text.find(s)
                if i != -1:
                    text = text[: i + len(s) if req.params.include_stop_str_in_output else i]
                    finish, req.stop_reason = FinishReason.STOP, s
                    break
    req.finish_reason = finish
    out = RequestOutput(
        request_id=req.request_id,
        new_token_ids=tuple(req.output_token_ids),
        text=text,
        logprobs=(logprob,) if logprob is not None else (),
        finished=True,
        finish_reason=finish,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=len(req.output_token_ids),
        stop_reason=req.stop_reason,
        exec_class=req.exec_class,
        num_cached_tokens=req.num_cached_tokens,
    )
    return with_head(out, head)
