"""The embeddings baseline: a small FastAPI app around `sentence-transformers`.

`python -m prelude.bench.peers.st_server --port P` serves the packaged all-MiniLM-L6-v2
(the same files `prelude serve --model all-MiniLM-L6-v2` loads) with an OpenAI-shaped
`/v1/embeddings` (`input`: str or list of str; normalized float vectors) and `/health`.
`SentenceTransformer.encode` batches the texts of one request; requests run one at a
time on one worker thread. Benchmark peer only.
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI


def build(device: str = "cpu") -> FastAPI:
    from sentence_transformers import SentenceTransformer

    from prelude.model.loading.files import embedded_model_path

    model_dir = embedded_model_path("all-MiniLM-L6-v2")
    # Weights load on the thread that runs every encode (torch's OpenMP team is per thread).
    worker = ThreadPoolExecutor(max_workers=1)
    model = worker.submit(lambda: SentenceTransformer(str(model_dir), device=device)).result()
    app = FastAPI()

    def encode(texts: list[str]) -> list[list[float]]:
        vectors = model.encode(texts, batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True)
        return [v.tolist() for v in vectors]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/v1/embeddings")
    async def embeddings(body: dict[str, Any]) -> Any:
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vectors = await asyncio.get_running_loop().run_in_executor(worker, encode, texts)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": "all-MiniLM-L6-v2"}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(build(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
