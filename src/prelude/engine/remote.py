"""What a front needs when its engine runs in another process or on another host: the
engine's facts (ReplicaInfo), validation done once in the front (ValidatingFront), and the
engine side's re-binding of a Request prepared elsewhere (bind_prepared).

Shared by the Ray fronts (prelude.cluster) and the multi-process HTTP front
(prelude.entrypoints.multiproc); nothing here imports Ray.
"""

from __future__ import annotations

import pickle
import random
import time
from dataclasses import dataclass, replace

from prelude.engine.engine import LLMEngine
from prelude.engine.grammar import grammar_text
from prelude.engine.request import LoraRequest, PoolingParams, Request, SamplingParams
from prelude.engine.validation import RequestRules, validate_request
from prelude.params import EmbedSetup
from prelude.tokenizer.base import Tokenizer


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front needs to validate requests the way a replica's engine would."""

    model_name: str
    tokenizer: Tokenizer | None  # None when it does not pickle (fasttoken): the front loads its own
    is_encoder: bool
    block_size: int
    rules: RequestRules  # the replica engine's own: the front validates exactly as it would


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - any failure means "load it on the other side"
        return False
    return True


def replica_info(engine: LLMEngine, with_tokenizer: bool = True) -> ReplicaInfo:
    """`with_tokenizer=False`: the front loads its own (it is large to ship)."""
    return ReplicaInfo(
        model_name=engine.model_name,
        tokenizer=engine.tokenizer if with_tokenizer and _picklable(engine.tokenizer) else None,
        is_encoder=engine.is_encoder,
        block_size=engine.config.cache.block_size,
        rules=engine.request_rules,
    )


def bind_prepared(engine: LLMEngine, req: Request) -> Request:
    """A Request prepared by a front, made this engine's: the monotonic clocks of two
    processes (or hosts) differ, so this engine's clock starts it; the front checked the
    structured-output constraint, the matcher is built here, next to its engine."""
    now = time.monotonic()
    deadline = None if req.ttft_deadline is None else now + (req.ttft_deadline - req.arrival_time)
    return engine.attach_grammar(replace(req, arrival_time=now, ttft_deadline=deadline))


class ValidatingFront:
    """The EngineClient half every front over a remote engine shares: the model's facts
    (from the engine) and validation, done once here with the same checks as
    LLMEngine.prepare (a Request is plain data: it travels to the engine as it is)."""

    def __init__(self, info: ReplicaInfo, seed: int = 0) -> None:
        self.info = info
        # Unseeded requests draw their sampling seed here, at validation, as the engine does.
        self._seed_source = random.Random(seed)
        self._adapter_labels: dict[int, tuple[str, ...]] = {}  # LoRA id -> its own head's labels (check_adapter)

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.rules.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.info.tokenizer is not None, "the front needs a tokenizer (see launch.start_client)"
        return self.info.tokenizer

    @property
    def labels(self) -> tuple[str, ...]:
        return self.info.rules.labels

    @property
    def can_generate(self) -> bool:
        return self.info.rules.can_generate

    @property
    def is_encoder(self) -> bool:
        return self.info.is_encoder

    @property
    def embed_setup(self) -> EmbedSetup | None:
        return self.info.rules.embed

    @property
    def score_template(self) -> str | None:
        return self.info.rules.score_template

    def _prepare(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None,
        lora: LoraRequest | None = None,
    ) -> Request:
        rules = self.info.rules
        if lora is not None and self._adapter_labels.get(lora.id):  # an adapter with its own classification head
            rules = replace(rules, labels=self._adapter_labels[lora.id])
        req = validate_request(request_id, prompt_token_ids, params, rules, seed_source=self._seed_source,
                               pooling=pooling, lora=lora)
        if params.structured is not None and pooling is None:
            grammar_text(params.structured)  # a malformed constraint is a 400 here, not a failed stream
        return req

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, pooling: PoolingParams | None = None,
        lora: LoraRequest | None = None,
    ) -> None:
        self._prepare("validate", prompt_token_ids, params, pooling, lora)
