"""The thin wrapper of layer_loop.c: its structs as ctypes declares them, the library
built for this CPU, and its one entry point. model/fast_paths/layer_loop.py binds a model's
layers to it and says which steps it takes."""

from __future__ import annotations

import ctypes
from pathlib import Path

from prelude.kernels.cpu import native_lib

_SOURCE = Path(__file__).with_name("layer_loop.c")
SWITCH = "PRELUDE_LAYER_LOOP"

ROUTE_SLOTS = 3  # layer_loop.c's (upto, via) intervals a projection holds
_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class ProjStruct(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("bias", _ptr), ("out", _i64), ("k", _i64), ("kind", _i32), ("qs", _ptr),
                ("d", _ptr), ("mins", _ptr), ("packed", _ptr), ("upto", _i64 * ROUTE_SLOTS),
                ("via", _i32 * ROUTE_SLOTS)]


class LayerStruct(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr), ("qkv", ProjStruct),
                ("o", ProjStruct), ("gate_up", ProjStruct), ("down", ProjStruct), ("k_cache", _ptr), ("v_cache", _ptr)]


class ModelStruct(ctypes.Structure):
    _fields_ = [("norm", _ptr), ("rope", _ptr), ("silu", _ptr), ("rows", _ptr), ("gemm", _ptr), ("blocks", _ptr),
                ("attend", _ptr), ("n_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("inter", _i64), ("eps", _f32), ("scale", _f32), ("layers", ctypes.POINTER(LayerStruct)),
                ("final_norm", _ptr), ("scb", _i64), ("scs", _i64), ("sch", _i64), ("block_size", _i64),
                ("attend_options", _i32), ("bf", _i32)]


class StepStruct(ctypes.Structure):
    _fields_ = [("rows", _i64), ("h_in", _ptr), ("cos", _ptr), ("sin", _ptr), ("n_pre", _i64), ("pre_start", _ptr),
                ("pre_len", _ptr), ("pre_ctx", _ptr), ("pre_own", _ptr), ("pre_tables", _ptr), ("pre_tstride", _i64),
                ("n_dec", _i64), ("dec_index", _ptr), ("dec_ctx", _ptr), ("dec_tables", _ptr), ("dec_tstride", _i64),
                ("slots", _ptr), ("n_slots", _i64), ("n_read", _i64), ("read_index", _ptr), ("pre_tail", _ptr),
                ("h_a", _ptr), ("h_b", _ptr), ("normed", _ptr), ("qkv", _ptr), ("q", _ptr), ("k", _ptr), ("v", _ptr),
                ("attn", _ptr), ("proj", _ptr), ("gate_up", _ptr), ("act", _ptr), ("xsum", _ptr), ("out", _ptr),
                ("threads", _i32)]



def load_layer_loop() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """prelude_layer_loop(Model*, Step*) -> int, declared; None where the library does not
    build here or PRELUDE_LAYER_LOOP=0."""
    lib = native_lib.load(_SOURCE, SWITCH, "the small steps' layer loop in C (the Python loop runs them)")
    if lib is None:
        return None
    fn = lib.prelude_layer_loop
    fn.argtypes = [ctypes.POINTER(ModelStruct), ctypes.POINTER(StepStruct)]
    fn.restype = ctypes.c_int
    return fn


def build() -> Path:
    """Compile the library into the cache unless it is there (`make install` calls this)."""
    return native_lib.build(_SOURCE)
