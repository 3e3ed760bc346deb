"""The KV hand-off between two engines (prefill/decode disaggregation).

A prefill engine computes a prompt, samples the first token (so the time to first token
is the prefill side's), copies the request's KV blocks out and lets go of them; a decode
engine copies them into blocks of its own and continues the request as a running decode
whose output stream picks up after the first token. A model with recurrent layers hands
over the request's state slot too (each linear layer's conv and recurrent state after
the prompt), which the decode engine copies into a slot of its own. The payload is plain data (host
tensors and the Request's state), so it travels through Ray's object store as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from prelude.engine.request import Request, RequestStatus

KVBlocks = list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: K, V of [blocks, block_size, heads, head_dim]
# per recurrent layer: conv state [channels, kernel - 1], recurrent state [heads, k dim, v dim] (float32)
RecurrentState = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVHandoff:
    request: Request  # the state to resume: prompt, params, seed, output_token_ids == [first token]
    num_computed_tokens: int  # tokens whose K/V are in `kv` (the prompt; the first token's are not)
    block_size: int
    kv: KVBlocks  # the request's blocks in table order, the last one possibly partly filled
    exported_at: float = 0.0  # the prefill engine's monotonic clock at the hand-off
    state: RecurrentState = field(default_factory=list)  # [] for a model without recurrent layers

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def first_token(self) -> int:
        return self.request.output_token_ids[0]

    @property
    def num_blocks(self) -> int:
        return int(self.kv[0][0].shape[0]) if self.kv else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in (*self.kv, *self.state))


def resumable_copy(req: Request) -> Request:
    """The request's state as the next engine starts from it: its own lists, no engine
    objects (a grammar matcher is rebuilt from the params there), scheduling state fresh."""
    return replace(
        req, prompt_token_ids=list(req.prompt_token_ids), output_token_ids=list(req.output_token_ids),
        grammar=None, hand_off=False, status=RequestStatus.WAITING, finish_reason=None, stop_reason=None,
        num_computed_tokens=0,
        mlfq_level=0, mlfq_used=0, mlfq_starved_steps=0, deferred_steps=0,
    )
