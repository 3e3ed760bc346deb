"""/v1/files and /v1/batches in OpenAI's shapes, so the unmodified `openai` client can
upload a batch file, run it, follow it and download its output. The files and batch
states live in a BatchStore on disk; batches run in a BatchRunner on the server's engine,
behind interactive requests. The app's API key and body limit (413) apply here too:
they are middlewares in front of every route."""

from __future__ import annotations

import os
from typing import Any, Iterator, Literal

from fastapi import FastAPI, File, Form, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import field_validator

from prelude.entrypoints.batch.store import BatchStore
from prelude.entrypoints.batch.worker import BatchRunner
from prelude.entrypoints.openai.errors import APIError
from prelude.entrypoints.openai.protocol import RequestBody
from prelude.entrypoints.openai.routes import ROUTES

FILE_PURPOSES = ("batch", "batch_output", "assistants", "fine-tune", "vision", "user_data", "evals")
_CHUNK = 1 << 20


# OpenAI's bounds on a batch's metadata; the record is rewritten while its batch runs
METADATA_MAX_PAIRS, METADATA_KEY_MAX_CHARS, METADATA_VALUE_MAX_CHARS = 16, 64, 512


class BatchCreateRequest(RequestBody):
    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > METADATA_MAX_PAIRS:
            raise ValueError(f"at most {METADATA_MAX_PAIRS} key-value pairs")
        for key, value in metadata.items():
            if len(key) > METADATA_KEY_MAX_CHARS:
                raise ValueError(f"keys are at most {METADATA_KEY_MAX_CHARS} characters")
            if len(value) > METADATA_VALUE_MAX_CHARS:
                raise ValueError(f"values are at most {METADATA_VALUE_MAX_CHARS} characters")
        return metadata


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after `after`, at most `limit`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def _limit(limit: int) -> int:
    if not 1 <= limit <= 10_000:
        raise APIError("limit must be between 1 and 10000", param="limit")
    return limit


def install_batch_routes(app: FastAPI, runner: BatchRunner) -> None:
    store: BatchStore = runner.store

    async def _start() -> None:
        runner.start()  # resumes the batches a stopped server left unfinished

    app.router.on_startup.append(_start)
    app.router.on_shutdown.append(runner.stop)

    def _no_file(file_id: str) -> APIError:
        return APIError(f"No such File object: {file_id}", 404, param="file_id", code="not_found")

    def _file(file_id: str) -> dict[str, Any]:
        record = store.file(file_id)
        if record is None:
            raise _no_file(file_id)
        return record

    def _batch(batch_id: str) -> dict[str, Any]:
        record = runner.record(batch_id)
        if record is None:
            raise APIError(f"No such Batch object: {batch_id}", 404, param="batch_id", code="not_found")
        return record

    @app.post("/v1/files")
    async def create_file(file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        if purpose not in FILE_PURPOSES:
            raise APIError(f"purpose must be one of {', '.join(FILE_PURPOSES)}", param="purpose")
        file_id = store.new_file_id()
        with open(store.file_path(file_id), "wb") as out:
            while chunk := await file.read(_CHUNK):
                out.write(chunk)
        return store.add_file(file_id, file.filename or "upload.jsonl", purpose)

    @app.get("/v1/files")
    async def list_files(purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                         order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
        files = sorted((f for f in store.files() if purpose is None or f["purpose"] == purpose),
                       key=lambda f: (f["created_at"], f["id"]), reverse=order == "desc")
        return _page(files, after, _limit(limit))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str) -> dict[str, Any]:
        return _file(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> StreamingResponse:
        _file(file_id)
        # Opened here, before the answer starts: a delete racing the download then either
        # comes first (a 404) or leaves this open copy whole (a path handed to a response
        # that opened it later gave a 500 naming the server's path, or a cut-off body).
        try:
            data = open(store.file_path(file_id), "rb")  # noqa: SIM115 - closed by the stream
        except FileNotFoundError:
            raise _no_file(file_id) from None
        size = os.fstat(data.fileno()).st_size

        def chunks() -> Iterator[bytes]:
            with data:
                while chunk := data.read(_CHUNK):
                    yield chunk

        return StreamingResponse(chunks(), media_type="application/jsonl", headers={"content-length": str(size)})

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict[str, Any]:
        _file(file_id)
        store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(body: BatchCreateRequest) -> dict[str, Any]:
        if body.endpoint not in ROUTES:
            known = ", ".join(sorted(u for u in ROUTES if u.startswith("/v1/")))
            raise APIError(f"endpoint must be one of {known}", param="endpoint", code="invalid_endpoint")
        source = _file(body.input_file_id)
        if source["purpose"] != "batch":
            raise APIError(f"the input file {body.input_file_id} was uploaded with purpose {source['purpose']!r}, "
                           "not 'batch'", param="input_file_id")
        batch = store.new_batch(body.endpoint, body.input_file_id, body.completion_window, body.metadata)
        runner.submit(batch["id"])
        return batch

    @app.get("/v1/batches")
    async def list_batches(limit: int = 20, after: str | None = None) -> dict[str, Any]:
        batches = [runner.record(b["id"]) or b for b in reversed(store.batches())]  # newest first, as OpenAI
        return _page(batches, after, _limit(limit))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str) -> dict[str, Any]:
        return _batch(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        _batch(batch_id)
        batch = runner.cancel(batch_id)
        assert batch is not None
        return batch
