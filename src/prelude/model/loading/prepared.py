"""Tensors a decoder's build derives from its checkpoint, kept on disk between starts.

A bf16 start casts every float32 tensor, stacks q/k/v and gate/up into fused weights and
stacks their GGUF blocks alike, and in a server, where the HTTP modules import on the
other thread meanwhile, that build is the start's critical path. The first start writes
what it derived into one safetensors file; later
starts map that file (pages read on first touch, shared with the page cache) and derive
nothing.

The file's name holds everything its tensors depend on: the checkpoint's files (path,
size, mtime), the dtype, torch's version and a digest of the code that derives them. An entry the file
lacks is derived as before, and the file is written again, whole, at the end of the build.
A save drops what no start will read again, but keeps the most recently used file of
other deriving code for the same checkpoint (another installed version).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from prelude.kernels.ggml_quants import GgmlQuants

logger = logging.getLogger("prelude.model.loading.prepared")

_FORMAT = 1  # bumped when what a key stands for changes in a way the digested code cannot show
_ALIGN = 64  # bytes: every tensor of the file starts on a cache line (write_aligned)
_PAD = "\x00pad:"  # fillers between tensors; no derived entry's key starts so
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                       torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                       torch.bool: "BOOL"}
# Checkpoints smaller than this derive in a blink and get no file: tests' random-weight
# models in temporary folders would otherwise leave one per folder.
MIN_CHECKPOINT_BYTES = 128 << 20
# Files of the same checkpoint and dtype made by other deriving code that a save keeps (the
# most recently used first): a second version of Prelude beside this one.
KEEP_OTHER_CODE = 1
_FOLDER = "\x00folder"  # metadata: the checkpoint's folder, so a save can drop files of deleted ones
# The modules whose code decides each entry's bits: a change to any of them is a new file.
_DERIVING_CODE = ("model/decoder.py", "kernels/ggml_quants.py", "model/loading/prepared.py", "kernels/cpu/amx_gemm.py",
                  "kernels/cpu/amx_gemm.c")  # under the prelude package


class PreparedTensors:
    """Derived tensors by key: read from the file where it has them, else made (and kept
    for `save`). `path` None: nothing is read or written (random-weight models, tests)."""

    def __init__(self, path: Path | None, folder: Path | None = None) -> None:
        """`folder`: the checkpoint's, recorded in the file (a later save drops the file once
        the folder is gone)."""
        self.path, self.folder = path, folder
        self._stored: dict[str, torch.Tensor] = {}
        self._kinds: dict[str, str] = {}
        self._used: dict[str, torch.Tensor] = {}
        self._used_kinds: dict[str, str] = {}
        self.made = 0  # entries derived in this build
        self.read = 0  # entries taken from the file
        if path is not None and path.is_file():
            self._read(path)

    @staticmethod
    def for_checkpoint(files: Iterable[Path], dtype: torch.dtype, cache_dir: Path,
                       min_bytes: int = MIN_CHECKPOINT_BYTES) -> PreparedTensors:
        """The store for a checkpoint's `files` built in `dtype`, under `cache_dir`; one that
        keeps nothing when the files hold fewer than `min_bytes`."""
        files = sorted(Path(f).resolve() for f in files)
        stats = [f.stat() for f in files]
        if sum(st.st_size for st in stats) < min_bytes:
            return PreparedTensors(None)
        inputs = hashlib.sha256(f"{_FORMAT}|{torch.__version__}|{dtype}".encode())
        for f, st in zip(files, stats):
            inputs.update(f"|{f}|{st.st_size}|{st.st_mtime_ns}".encode())
        # The folder's name and a hash of its path: two checkpoints in folders of one name keep
        # a file each (a save drops only the files of its own checkpoint and dtype).
        folder = files[0].parent if files else Path("model")
        stem = f"{folder.name}-{hashlib.sha256(str(folder).encode()).hexdigest()[:8]}"
        dtype_name = str(dtype).removeprefix("torch.")
        name = f"{stem}-{dtype_name}.{inputs.hexdigest()[:12]}.{_deriving_code_digest().hex()[:8]}.safetensors"
        return PreparedTensors(cache_dir / name, folder)

    def tensor(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The entry `key`: the file's, else `make()`."""
        found = self._stored.get(key)
        if found is None:
            found = make()
            self.made += 1
        else:
            self.read += 1
        self._used[key] = found
        return found

    def blocks(self, key: str, make: Callable[[], GgmlQuants | None]) -> GgmlQuants | None:
        """The block-format entry `key` (None is an answer too): the file's, else `make()`."""
        kind = self._kinds.get(key)
        parts = {p: self._stored[f"{key}.{p}"] for p in ("qs", "d", "m") if f"{key}.{p}" in self._stored}
        needed = {"qs", "d", "m"} if kind == "q4_1" else {"qs", "d"}
        if kind not in (None, "none") and not needed <= parts.keys():
            kind = None  # a part is missing (a file not of this writer): derive it again
        if kind is None:
            made = make()
            self.made += 1
            kind = "none" if made is None else made.kind
            if made is not None:
                self._used |= {f"{key}.{part}": t for part, t in _block_parts(made).items()}
            self._used_kinds[key] = kind
            return made
        self._used_kinds[key] = kind
        self.read += 1
        if kind == "none":
            return None
        self._used |= {f"{key}.{p}": t for p, t in parts.items()}
        return GgmlQuants(kind, parts["qs"], parts["d"], parts.get("m"))

    def save(self) -> bool:
        """Write the entries this build used, when it derived any (atomically: a reader never
        sees half a file), and remove the files it supersedes (_superseded). Whether it
        wrote; a failure only costs later starts their derivation."""
        if self.path is None or self.made == 0:
            return False
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        metadata = self._used_kinds | ({_FOLDER: str(self.folder)} if self.folder is not None else {})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_aligned(tmp, self._used, metadata)
            tmp.replace(self.path)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:  # disk full, read-only cache, a dtype
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            logger.warning("could not keep the prepared weights in %s (%s)", self.path, exc)
            return False
        for old in _superseded(self.path):
            old.unlink(missing_ok=True)
        return True

    def _read(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                self._kinds = dict(f.metadata() or {})
                self._stored = {k: _aligned(f.get_tensor(k)) for k in f.keys() if not k.startswith(_PAD)}
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:  # truncated or foreign: derive again
            logger.warning("ignoring the unreadable prepared weights %s (%s)", path, exc)
            self._stored, self._kinds = {}, {}
            return
        with contextlib.suppress(OSError):
            os.utime(path)  # its mtime is its last use: what _superseded keeps the newest of


def _superseded(path: Path) -> list[Path]:
    """The files a save of `path` drops: those of checkpoints whose folder is gone; of the
    same checkpoint and dtype, those for other files (a changed checkpoint, another torch)
    or of an earlier naming; and of the same inputs but other deriving code, all but the
    most recently used one (two versions of Prelude on one machine, or an old vs new bench,
    would otherwise drop each other's file at every start)."""
    prefix, inputs, _code, _ = path.name.rsplit(".", 3)
    other_code: list[tuple[float, Path]] = []
    drop: list[Path] = []
    for old in path.parent.glob("*.safetensors"):
        if old == path:
            continue
        parts = old.name.rsplit(".", 3)
        if old.name.startswith(prefix + "-"):  # the earlier naming: {stem}-{dtype}-{key}.safetensors
            drop.append(old)
        elif len(parts) == 4 and parts[0] == prefix:
            if parts[1] != inputs:
                drop.append(old)
            else:
                with contextlib.suppress(OSError):
                    other_code.append((old.stat().st_mtime, old))
        elif _folder_gone(old):
            drop.append(old)
    other_code.sort(reverse=True)
    return drop + [old for _, old in other_code[KEEP_OTHER_CODE:]]


def write_aligned(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file whose every tensor starts on a 64-byte boundary of the file (and so
    of a mapping of it). safetensors' own writer packs tensors at 8 bytes: a mapped bf16
    weight then splits every 64-byte load over two cache lines, and the kernels that read
    plain weights (few-row projections, the head) ran measurably slower. The format allows
    no holes, so a gap is a named uint8 filler, which readers skip."""
    header: dict[str, object] = {"__metadata__": metadata}
    layout: list[torch.Tensor | int] = []  # tensors, and filler byte counts between them
    at = 0
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if gap := -at % _ALIGN:
            header[f"{_PAD}{i}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [at, at + gap]}
            layout.append(gap)
            at += gap
        t = t.detach().contiguous().cpu()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        layout.append(t)
        at += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)  # the data starts on a boundary too
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for part in layout:
            f.write(bytes(part) if isinstance(part, int) else part.reshape(-1).view(torch.uint8).numpy().data)


@functools.cache
def _deriving_code_digest() -> bytes:
    here = Path(__file__).resolve().parents[2]  # the prelude package
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in _DERIVING_CODE)).digest()


def _folder_gone(path: Path) -> bool:
    """Whether the checkpoint folder `path` records no longer exists (reads the header only)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(size, 64 << 20)))
        folder = header.get("__metadata__", {}).get(_FOLDER)
    except (OSError, ValueError, struct.error, AttributeError):
        return False  # not ours to judge
    return isinstance(folder, str) and not Path(folder).is_dir()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied where it does not start on a 64-byte boundary (a file another writer made)."""
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _block_parts(blocks: GgmlQuants) -> dict[str, torch.Tensor]:
    parts = {"qs": blocks.qs, "d": blocks.d}
    if blocks.m is not None:
        parts["m"] = blocks.m
    return parts
