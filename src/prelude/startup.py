"""`prelude serve`'s checks before anything loads, so a start-up mistake ends in one line
that names the problem and the fix (the stack, if any, goes to the debug log).

The checks run in the order a mistake costs least: flag ranges (no imports), the port (a
socket), the model's files (headers and config only, never the weights), then the device
(torch). What only loading can tell (a tensor the converter does not know) still fails
later, in the same one-line form (see cli._serve).
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
from dataclasses import dataclass
from pathlib import Path


class StartupError(Exception):
    """A start-up mistake: the message says what is wrong and how to fix it, in one line."""


@dataclass(frozen=True)
class _Range:
    flag: str
    low: float
    inclusive: bool = True  # low itself allowed

    def check(self, value: float | None) -> None:
        if value is None:
            return
        if value < self.low or (value == self.low and not self.inclusive):
            bound = f"{self.low:g} or more" if self.inclusive else f"more than {self.low:g}"
            raise StartupError(f"{self.flag} {value:g} is out of range: pass a value of {bound}")


# argparse dest -> the range its flag takes; None values (flag not given) pass.
_RANGES: dict[str, _Range] = {
    "kv_cache_memory_gib": _Range("--kv-cache-memory-gib", 0, inclusive=False),
    "block_size": _Range("--block-size", 1),
    "max_num_seqs": _Range("--max-num-seqs", 1),
    "max_num_batched_tokens": _Range("--max-num-batched-tokens", 1),
    "max_model_len": _Range("--max-model-len", 1),
    "max_decode_batch": _Range("--max-decode-batch", 1),
    "prefix_cache_max_blocks": _Range("--prefix-cache-max-blocks", 0),
    "seed": _Range("--seed", 0),
    "port": _Range("--port", 0),
    "max_waiting_requests": _Range("--max-waiting-requests", 0),
    "max_request_body_bytes": _Range("--max-request-body-bytes", 1),
    "max_request_tokens": _Range("--max-request-tokens", 1),
    "max_batch_inputs": _Range("--max-batch-inputs", 1),
    "request_timeout": _Range("--request-timeout", 0, inclusive=False),
    "shutdown_timeout": _Range("--shutdown-timeout", 0),
    "data_parallel_size": _Range("--data-parallel-size", 1),
    "replica_threads": _Range("--replica-threads", 1),
    "max_requests_in_scheduler": _Range("--max-requests-in-scheduler", 1),
    "api_server_count": _Range("--api-server-count", 1),
    "max_inflight": _Range("--max-inflight", 1),
    "batch_max_inflight": _Range("--batch-max-inflight", 1),
}


def check_flags(args: argparse.Namespace) -> None:
    for dest, rule in _RANGES.items():
        rule.check(getattr(args, dest, None))
    utilization = getattr(args, "gpu_memory_utilization", None)
    if utilization is not None and not 0 < utilization <= 1:
        raise StartupError(f"--gpu-memory-utilization {utilization:g} is out of range: pass a fraction in (0, 1]")
    if getattr(args, "port", 0) > 65535:
        raise StartupError(f"--port {args.port} is out of range: use 1-65535 (or 0 for any free port)")
    overrides = getattr(args, "hf_overrides", None)
    if overrides is not None:
        try:
            value = json.loads(overrides)
        except ValueError as exc:
            raise StartupError(f"--hf-overrides is not JSON ({exc}): pass an object, e.g. '{{\"is_matryoshka\": true}}'") from None
        if not isinstance(value, dict):
            raise StartupError("--hf-overrides is not a JSON object: pass an object, e.g. '{\"is_matryoshka\": true}'")


def check_device(device: str, dtype: str) -> None:
    """The device exists (`--device cuda` on a machine without CUDA is the usual miss)."""
    import torch

    from prelude.executor.device import resolve_device, resolve_dtype

    try:
        resolved = resolve_device(device)
    except RuntimeError:  # torch.device() refuses a malformed name
        raise StartupError(f"--device {device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    except ValueError as exc:
        fix = "drop --device (auto) or pass --device cpu" if "CUDA" in str(exc) else "use auto, cpu, cuda or cuda:N"
        raise StartupError(f"--device {device}: {exc}; {fix}") from None
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise StartupError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s); "
                           f"pick one of cuda:0..cuda:{torch.cuda.device_count() - 1}")
    try:
        resolve_dtype(dtype, resolved)
    except ValueError as exc:
        raise StartupError(f"--dtype {dtype}: {exc}") from None


def check_port(host: str, port: int) -> None:
    """Bind the address the server will listen on, and let it go: a port another process
    listens on fails here, before minutes of loading, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"port {port} on {host} is already in use: stop the process that listens "
                                   f"there (`ss -ltnp 'sport = :{port}'`) or pass another --port") from None
            raise StartupError(f"cannot listen on {host}:{port} ({exc.strerror}): "
                               "check --host and --port") from None


def check_model(model: str | None, max_model_len: int | None, hf_overrides: str | None = None) -> None:
    """The model's files are there and readable (headers and config.json only, with
    --hf-overrides' fields over it), and --max-model-len fits the model's context."""
    path = Path(model).expanduser() if model is not None else None
    if path is None or not path.exists():  # the default model, or one by its name (imports torch)
        from prelude.model.loading.files import default_model_path, embedded_model_path

        try:
            path = default_model_path() if model is None else (embedded_model_path(model) or path)
        except FileNotFoundError as exc:  # an embedded model whose package is missing
            raise StartupError(str(exc)) from None
    if not path.exists():
        raise StartupError(f"--model {model}: no such file or directory; pass a HF model directory "
                           "(config.json + *.safetensors) or a .gguf file, or drop --model for the default model")
    if path.is_file():
        context = _gguf_context(path, model)
    else:
        context = _hf_dir_context(path, json.loads(hf_overrides) if hf_overrides else {})
    if max_model_len is not None and context is not None and max_model_len > context:
        raise StartupError(f"--max-model-len {max_model_len} is over the model's context of {context} tokens: "
                           f"pass --max-model-len {context} or less (or drop it)")


def _gguf_context(path: Path, model: str | None) -> int | None:
    from prelude.model.loading.files import cached_gguf_dir

    if path.suffix != ".gguf":
        raise StartupError(f"--model {model}: {path.name} is a file but not a .gguf; pass a .gguf file "
                           "or a HF model directory (config.json + *.safetensors)")
    # A GGUF an earlier start converted was readable and supported then: its copy's
    # config.json says the context without reading the GGUF's header (its whole vocabulary)
    # or importing the gguf package.
    converted = cached_gguf_dir(path)
    if converted is not None:
        return _hf_dir_context(converted)
    from prelude.model.loading.gguf_file import GgufFile

    try:
        gguf = GgufFile(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means the same: not a GGUF we can read
        raise StartupError(f"--model {model}: {path.name} is not a readable GGUF file ({exc}); "
                           "download it again or pass another model") from None
    arch = str(gguf.field("general.architecture"))
    from prelude.model.base import UnsupportedCheckpoint
    from prelude.model.registry import gguf_architecture

    try:
        gguf_architecture(arch)
        from prelude.model.loading.gguf_convert import check_gguf

        check_gguf(gguf)  # its tensors and config too, from the header
    except UnsupportedCheckpoint as exc:
        raise StartupError(f"--model {model}: {exc}") from None
    context = gguf.field(f"{arch}.context_length")
    return int(context) if context is not None else None


def _hf_dir_context(path: Path, overrides: dict[str, object] | None = None) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        raise StartupError(f"--model {path}: the directory has no config.json, so it is not a HF model directory; "
                           "pass the folder that holds config.json and *.safetensors, or a .gguf file")
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StartupError(f"--model {path}: config.json is not readable JSON ({exc}); "
                           "download the model again") from None
    if not any(path.glob("*.safetensors")):
        raise StartupError(f"--model {path}: no *.safetensors weights next to config.json; download the weights "
                           "(or convert *.bin with safetensors' convert script)")
    if not isinstance(raw, dict):
        raise StartupError(f"--model {path}: config.json is not a JSON object; download the model again")
    from prelude.model.base import UnsupportedCheckpoint
    from prelude.model.registry import config_for

    raw = {**raw, **(overrides or {})}
    try:
        config_for(raw, path)  # an architecture, or a config field, this engine cannot compute: one line
    except UnsupportedCheckpoint as exc:
        raise StartupError(f"--model {path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise StartupError(f"--model {path}: config.json lacks or misstates {exc} (the architecture's config needs "
                           "it); download the model's config.json again") from None
    context = raw.get("max_position_embeddings")
    return int(context) if isinstance(context, int) else None


def check_serve_args(args: argparse.Namespace) -> None:
    """Everything `prelude serve` can tell before it loads anything; raises StartupError."""
    check_engine_args(args)
    check_port(args.host, args.port)


def check_engine_args(args: argparse.Namespace) -> None:
    """The flags, model and device an engine is built from (`serve`, `run-batch`), before
    anything loads; raises StartupError. With --ray-address the replicas may run
    elsewhere: their device and files are theirs."""
    check_flags(args)
    if getattr(args, "ray_address", None) is not None:
        return
    check_model(args.model, args.max_model_len, getattr(args, "hf_overrides", None))
    if args.device != "auto" or args.dtype == "float16":  # auto/auto cannot be wrong; spares importing torch
        check_device(args.device, args.dtype)
