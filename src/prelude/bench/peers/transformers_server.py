"""The baseline most Python users start from: a small FastAPI app around `transformers`.

`python -m prelude.bench.peers.transformers_server --port P [--dtype bfloat16]` serves
the default model (its converted HF directory) with `/v1/completions` (string prompt,
max_tokens, temperature 0 or sampling, stream) and `/health`. One request at a time,
`model.generate` per request: no batching, no KV paging. Benchmark peer only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
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
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    app = FastAPI()
    lock = asyncio.Lock()  # transformers' generate is not safe to run concurrently

    def generate(prompt: str, max_tokens: int, temperature: float) -> tuple[str, int, int]:
        ids = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=max(1, max_tokens), do_sample=temperature > 0,
                                 temperature=temperature or None, pad_token_id=tok.eos_token_id)
        new = out[0, ids["input_ids"].shape[1]:]
        return tok.decode(new, skip_special_tokens=True), ids["input_ids"].shape[1], new.shape[0]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> Any:
        async with lock:
            text, n_in, n_out = await asyncio.to_thread(
                generate, body["prompt"], int(body.get("max_tokens", 16)), float(body.get("temperature", 1.0)))
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        if body.get("stream"):
            async def events() -> Any:
                yield f"data: {json.dumps({'choices': [choice], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"object": "text_completion", "created": int(time.time()), "choices": [choice],
                             "usage": usage})

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    uvicorn.run(build(args.dtype), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
