"""`prelude serve` start-up mistakes, each run as a real subprocess: a non-zero exit, one
line on stderr that names the problem and the fix, no traceback. Every case fails in the
checks before anything loads (seconds, not a model load)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gguf(path: Path, architecture: str) -> Path:
    """A GGUF v3 header with one string field and no tensors."""
    key, value = b"general.architecture", architecture.encode()
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 8) + struct.pack("<Q", len(value)) + value)
    return path


def _missing(tmp: Path) -> list[str]:
    return ["--model", str(tmp / "no-such-model")]


def _not_gguf(tmp: Path) -> list[str]:
    (tmp / "weights.txt").write_text("hello")
    return ["--model", str(tmp / "weights.txt")]


def _corrupt_gguf(tmp: Path) -> list[str]:
    (tmp / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00junk")  # cut off inside the header
    return ["--model", str(tmp / "cut.gguf")]


def _unsupported_gguf(tmp: Path) -> list[str]:
    return ["--model", str(_gguf(tmp / "gpt2.gguf", "gpt2"))]


def _empty_dir(tmp: Path) -> list[str]:
    (tmp / "empty").mkdir()
    return ["--model", str(tmp / "empty")]


# A Llama config.json of a tiny shape (what a HF directory's config says)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 260, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "hidden_act": "silu", "max_position_embeddings": 64}


def _dir_without_weights(tmp: Path) -> list[str]:
    (tmp / "cfg").mkdir()
    (tmp / "cfg" / "config.json").write_text(json.dumps(LLAMA))
    return ["--model", str(tmp / "cfg")]


def _hf_dir(tmp: Path, name: str, config: dict[str, object]) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"")  # never opened: the checks fail first
    return d


def _model_len_over_the_models(tmp: Path) -> list[str]:
    return ["--model", str(_hf_dir(tmp, "small-context", LLAMA)), "--max-model-len", "65"]


def _unknown_architecture(tmp: Path) -> list[str]:
    return ["--model", str(_hf_dir(tmp, "falcon", {**LLAMA, "architectures": ["FalconForCausalLM"]}))]


def _llama_with_gelu(tmp: Path) -> list[str]:
    return ["--model", str(_hf_dir(tmp, "gelu-llama", {**LLAMA, "hidden_act": "gelu"}))]


def _config_missing_a_field(tmp: Path) -> list[str]:
    return ["--model", str(_hf_dir(tmp, "no-heads", {k: v for k, v in LLAMA.items() if k != "num_attention_heads"}))]


# case -> (arguments, words the one line must hold: the problem and the fix)
CASES: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "missing-model": (_missing, ("no such file or directory", "pass a HF model directory")),
    "file-not-gguf": (_not_gguf, ("not a .gguf", "pass a .gguf file")),
    "corrupt-gguf": (_corrupt_gguf, ("not a readable GGUF", "download it again")),
    "unsupported-gguf": (_unsupported_gguf, ("'gpt2' is not supported", "supported: ", "llama", "qwen3moe")),
    "dir-without-config": (_empty_dir, ("no config.json", "pass the folder")),
    "unknown-architecture": (_unknown_architecture, ("architecture FalconForCausalLM is not supported",
                                                     "supported: ", "LlamaForCausalLM")),
    "llama-with-gelu": (_llama_with_gelu, ("LlamaForCausalLM", "hidden_act='gelu'", "supported: silu")),
    "config-missing-a-field": (_config_missing_a_field, ("config.json", "num_attention_heads")),
    "dir-without-weights": (_dir_without_weights, ("no *.safetensors", "download the weights")),
    "max-model-len-over-the-models": (_model_len_over_the_models, ("over the model's context of 64", "64 or less")),
    "kv-budget-negative": (lambda _: ["--kv-cache-memory-gib", "-1"], ("--kv-cache-memory-gib -1", "more than 0")),
    "kv-budget-zero": (lambda _: ["--kv-cache-memory-gib", "0"], ("--kv-cache-memory-gib 0", "more than 0")),
    "gpu-utilization-over-one": (lambda _: ["--gpu-memory-utilization", "1.5"],
                                 ("--gpu-memory-utilization 1.5", "a fraction in (0, 1]")),
    "gpu-utilization-zero": (lambda _: ["--gpu-memory-utilization", "0"],
                             ("--gpu-memory-utilization 0", "a fraction in (0, 1]")),
    "block-size-zero": (lambda _: ["--block-size", "0"], ("--block-size 0", "1 or more")),
    "max-num-seqs-zero": (lambda _: ["--max-num-seqs", "0"], ("--max-num-seqs 0", "1 or more")),
    "max-model-len-negative": (lambda _: ["--max-model-len", "-5"], ("--max-model-len -5", "1 or more")),
    "port-out-of-range": (lambda _: ["--port", "70000"], ("--port 70000", "1-65535")),
    "hf-overrides-not-json": (lambda _: ["--hf-overrides", "{is_matryoshka: true}"], ("--hf-overrides is not JSON",
                                                                                   "pass an object")),
    "hf-overrides-not-an-object": (lambda _: ["--hf-overrides", "[1]"], ("not a JSON object", "pass an object")),
}


def _serve(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "prelude.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


def _assert_one_line(done: subprocess.CompletedProcess[str], *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert lines[0].startswith("prelude serve: error: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("case", list(CASES))
def test_a_start_up_mistake_is_one_line(case: str, tmp_path: Path) -> None:
    make_args, words = CASES[case]
    _assert_one_line(_serve(["--port", "0", *make_args(tmp_path)]), *words)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_device_cuda_without_cuda_is_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _assert_one_line(_serve(["--device", "cuda", "--port", "0"]), "no CUDA device", "--device cpu")


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _assert_one_line(_serve(["--port", str(port)]), f"port {port}", "already in use", "another --port")


def test_a_gguf_converted_before_is_checked_from_its_copy_without_reading_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prelude.model.loading.files import _converted_target, cached_gguf_dir
    from prelude.startup import StartupError, check_model

    monkeypatch.setenv("PRELUDE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _gguf(tmp_path / "m.gguf", "gpt2")  # an unsupported architecture, were its header read
    with pytest.raises(StartupError, match="architecture 'gpt2' is not supported"):
        check_model(str(gguf), None)
    assert cached_gguf_dir(gguf) is None
    copy = _converted_target(gguf)
    copy.mkdir(parents=True)
    (copy / "config.json").write_text(json.dumps({**LLAMA, "max_position_embeddings": 512}))
    (copy / "model.safetensors").write_bytes(b"")
    assert cached_gguf_dir(gguf) == copy
    check_model(str(gguf), 512)  # the copy answers: its context, no architecture check of the header
    with pytest.raises(StartupError, match="over the model's context of 512"):
        check_model(str(gguf), 513)
