"""Reading a HF `config.json` for an architecture file: the fields every decoder shares, and
the refusal of fields that change the numbers where the architecture does not compute them.

A checkpoint's config may carry a field its architecture file ignores while transformers
honours it (an activation, a soft-cap, per-layer attention kinds, experts ...): served as
it is, the model would answer wrong from its first token. Each such field is listed here
with the value that means "not used"; an architecture names the fields it computes, and
any other one set to something else refuses the checkpoint in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prelude.model.base import UnsupportedCheckpoint


def _falsy(value: Any) -> bool:
    return not value


def _all_full(value: Any) -> bool:
    return value is None or all(kind == "full_attention" for kind in value)


def _one(value: Any) -> bool:
    return value is None or float(value) == 1.0


def _absent(value: Any) -> bool:
    return value is None


# Fields that change what a model computes, and when a value means "not used".
NUMERIC_FIELDS: dict[str, Callable[[Any], bool]] = {
    "attn_logit_softcapping": _absent,
    "final_logit_softcapping": _absent,
    "query_pre_attn_scalar": _absent,
    "layer_types": _all_full,
    "use_bidirectional_attention": _falsy,
    "num_experts": _falsy,
    "num_local_experts": _falsy,
    "num_experts_per_tok": _falsy,
    "moe_intermediate_size": _falsy,
    "shared_expert_intermediate_size": _falsy,
    "mlp_bias": _falsy,
    "attention_bias": _falsy,
    "partial_rotary_factor": _one,
    "embedding_multiplier": _absent,
    "logits_scaling": _absent,
    "residual_multiplier": _absent,
    "attention_multiplier": _absent,
    "qk_layernorm": _falsy,
    "use_qk_norm": _falsy,
    "attention_chunk_size": _absent,
    "no_rope_layers": _falsy,
    "full_attention_interval": _absent,
    "linear_num_value_heads": _absent,
    "linear_num_key_heads": _absent,
    "linear_key_head_dim": _absent,
    "linear_value_head_dim": _absent,
    "linear_conv_kernel_dim": _absent,
    "attn_output_gate": _falsy,
}

# The rotary scalings the rotary layer computes (model/layers/rotary.py)
ROPE_TYPES = ("default", "linear", "llama3")


def refuse_unhandled(architecture: str, raw: Mapping[str, Any], handled: Iterable[str] = ()) -> None:
    """Raise UnsupportedCheckpoint naming the first field of NUMERIC_FIELDS that `raw` sets
    to a value that changes the numbers, unless the architecture computes it (`handled`)."""
    skip = set(handled)
    for name, unused in NUMERIC_FIELDS.items():
        if name in skip or name not in raw:
            continue
        if not unused(raw[name]):
            raise UnsupportedCheckpoint(
                f"architecture {architecture}: config field {name}={_short(raw[name])} is not supported "
                "(the engine would compute the model without it)")


def require(architecture: str, raw: Mapping[str, Any], field: str, allowed: Iterable[Any], default: Any) -> Any:
    """`raw[field]` (or `default`), refused unless it is one of `allowed`."""
    value = raw.get(field, default)
    allowed = tuple(allowed)
    if value not in allowed:
        raise UnsupportedCheckpoint(f"architecture {architecture}: config field {field}={_short(value)} is not "
                                    f"supported (supported: {', '.join(map(str, allowed))})")
    return value


def rope_of(architecture: str, raw: Mapping[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, the scaling items or None) from `rope_parameters` (transformers 5) or
    `rope_theta` / `rope_scaling`; a scaling the rotary layer does not compute is refused."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"] if theta is None else theta
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise UnsupportedCheckpoint(f"architecture {architecture}: rope scaling {kind!r} is not supported "
                                        f"(supported: {', '.join(ROPE_TYPES)})")
        items = None if kind in (None, "default") else tuple(sorted(scaling.items()))
    else:
        items = None
    return float(theta if theta is not None else 10000.0), items


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
