"""The baseline most Python users start from: a small FastAPI app around `transformers`.

`python -m prelude.bench.peers.transformers_server --port P [--dtype bfloat16]` serves
the default model (its converted HF directory) with `/v1/completions` (string prompt,
max_tokens, temperature 0 or sampling, ignore_eos, stream), `/classify` (label-token
classification of a list of texts: one padded forward, softmax over the labels' first
tokens) and `/health`. One request at a time, `model.generate` per completion: no
batching across requests, no KV paging. Benchmark peer only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse


def build(dtype: str) -> FastAPI:
    import transformers

    from prelude.model.loader import load_model_files

    model_dir = load_model_files(None).model_dir
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    # One worker thread loads the weights and runs every forward: generate is not safe to
    # run concurrently, and torch's OpenMP team belongs to the thread that first used it
    # (a forward from a fresh thread was ~30% slower here). A strong baseline, not a straw man.
    worker = ThreadPoolExecutor(max_workers=1)
    model = worker.submit(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    ).result()
    app = FastAPI()

    async def on_worker(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    tok.padding_side = "left"  # the last column is every row's last token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def generate(prompt: str, max_tokens: int, temperature: float, ignore_eos: bool) -> tuple[str, int, int]:
        ids = tok(prompt, return_tensors="pt")
        n = max(1, max_tokens)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n if ignore_eos else None,
                                 do_sample=temperature > 0, temperature=temperature or None,
                                 pad_token_id=tok.eos_token_id)
        new = out[0, ids["input_ids"].shape[1]:]
        return tok.decode(new, skip_special_tokens=True), ids["input_ids"].shape[1], new.shape[0]

    def classify(texts: list[str], labels: list[str]) -> list[dict[str, Any]]:
        label_ids = [tok.encode(label, add_special_tokens=False)[0] for label in labels]
        batch = tok(texts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            logits = model(**batch, logits_to_keep=1).logits[:, -1, :]
        probs = torch.softmax(logits[:, label_ids].float(), dim=-1)
        return [{"index": i, "label": labels[int(p.argmax())], "probs": p.tolist()} for i, p in enumerate(probs)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> Any:
        text, n_in, n_out = await on_worker(
            generate, body["prompt"], int(body.get("max_tokens", 16)), float(body.get("temperature", 1.0)),
            bool(body.get("ignore_eos", False)))
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        if body.get("stream"):
            async def events() -> Any:
                yield f"data: {json.dumps({'choices': [choice], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"object": "text_completion", "created": int(time.time()), "choices": [choice],
                             "usage": usage})

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
    args = ap.parse_args()
    uvicorn.run(build(args.dtype), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
