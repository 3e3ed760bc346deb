"""The baseline most Python users start from: a small FastAPI app around `transformers`.

`python -m prelude.bench.peers.transformers_server --port P [--dtype bfloat16]` serves
the default model (its converted HF directory) with `/v1/completions` (string prompt,
max_tokens, temperature 0 or sampling, ignore_eos, stream: token by token through a
generate streamer), `/classify` (label-token classification of a list of texts: one
padded forward, softmax over the labels' first tokens) and `/health`. One request at a time, `model.generate` per completion: no
batching across requests, no KV paging. Benchmark peer only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from transformers.generation.streamers import BaseStreamer


class _TokenQueue(BaseStreamer):
    """Hands generated token ids from the worker thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[int | None]) -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate first hands over the prompt
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def build(dtype: str, model: str | None = None, device: str = "cpu") -> FastAPI:
    import transformers

    from prelude.model.loading.files import load_model_files

    model_dir = Path(model) if model else load_model_files(None).model_dir
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    # One worker thread loads the weights and runs every forward: generate is not safe to
    # run concurrently, and torch's OpenMP team belongs to the thread that first used it
    # (a forward from another thread runs slower). A strong baseline, not a straw man.
    worker = ThreadPoolExecutor(max_workers=1)
    model = worker.submit(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    ).result()
    app = FastAPI()

    async def on_worker(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    tok.padding_side = "left"  # the last column is every row's last token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def generate(prompt: str, max_tokens: int, temperature: float, ignore_eos: bool,
                 streamer: BaseStreamer | None = None) -> tuple[str, int, int]:
        ids = tok(prompt, return_tensors="pt").to(device)
        n = max(1, max_tokens)
        try:
            with torch.inference_mode():
                out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n if ignore_eos else None,
                                     do_sample=temperature > 0, temperature=temperature or None,
                                     pad_token_id=tok.eos_token_id, streamer=streamer)
        finally:
            if streamer is not None:  # a failed generate must still end the stream
                streamer.end()
        new = out[0, ids["input_ids"].shape[1]:]
        return tok.decode(new, skip_special_tokens=True), ids["input_ids"].shape[1], new.shape[0]

    def classify(texts: list[str], labels: list[str]) -> list[dict[str, Any]]:
        label_ids = [tok.encode(label, add_special_tokens=False)[0] for label in labels]
        batch = tok(texts, return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            logits = model(**batch, logits_to_keep=1).logits[:, -1, :]
        probs = torch.softmax(logits[:, label_ids].float(), dim=-1)
        return [{"index": i, "label": labels[int(p.argmax())], "probs": p.tolist()} for i, p in enumerate(probs)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> Any:
        args = (body["prompt"], int(body.get("max_tokens", 16)), float(body.get("temperature", 1.0)),
                bool(body.get("ignore_eos", False)))
        if body.get("stream"):
            return StreamingResponse(_stream(args), media_type="text/event-stream")
        text, n_in, n_out = await on_worker(generate, *args)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        return JSONResponse({"object": "text_completion", "created": int(time.time()), "choices": [choice],
                             "usage": usage})

    async def _stream(args: tuple[Any, ...]) -> Any:
        """Streams each new token's text as generate produces it (the usual HF streamer
        recipe), then a usage chunk."""
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        job = asyncio.ensure_future(on_worker(generate, *args, _TokenQueue(asyncio.get_running_loop(), queue)))
        ids: list[int] = []
        sent = ""
        while (token := await queue.get()) is not None:
            ids.append(token)
            text = tok.decode(ids, skip_special_tokens=True)
            if len(text) > len(sent) and not text.endswith("\ufffd"):  # whole characters only
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text[len(sent):]}]})}\n\n"
                sent = text
        _, n_in, n_out = await job
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/classify")
    async def classify_route(body: dict[str, Any]) -> Any:
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = await on_worker(classify, texts, list(body["labels"]))
        return {"object": "list", "data": data}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="a HF model directory (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    uvicorn.run(build(args.dtype, args.model, args.device), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
