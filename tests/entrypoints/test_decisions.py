"""Typed decisions over HTTP (tiny random Llama, byte tokenizer, float32): OpenAI's
/v1/decisions through the real `openai` client, TypeSafe's /v1/systemone, batch lines;
every answer against transformers computing the options' log-probabilities on the prompt
ids the server says it read."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.entrypoints.batch.job import JobOptions, run_job

from tests.batch.conftest import read_output, write_lines
from tests.engine.tiny import EOS, hf_tiny_llama, tiny_engine
from tests.entrypoints.conftest import running_server

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

TOL = 1e-4
CONTEXT = 512  # the tiny Llama's max_position_embeddings
INPUT = "Order 1234 arrived broken; I want a refund."
QUESTIONS: list[dict[str, Any]] = [
    {"type": "predicate", "name": "refund", "instructions": "The customer asks for a refund."},
    {"type": "choice", "name": "letter", "instructions": "Pick a letter.",
     "choices": [{"value": "a"}, {"value": "b", "description": "the second"}, {"value": "c"}]},
    {"type": "choice", "instructions": "Which team?",  # multi-token values, one a prefix of another
     "choices": [{"value": "billing"}, {"value": "bill"}, {"value": "shipping"}]},
    {"type": "choice", "name": "typed", "instructions": "Is it true?",
     "choices": [{"value": True}, {"value": "true"}, {"value": False}]},
    {"type": "score", "name": "urgency", "instructions": "How urgent is it?",
     "levels": [{"label": "low"}, {"label": "mid", "description": "this week"}, {"label": "high"}]},
]
ANSWERED = {"refusal_threshold": 0, "return_prompt_token_ids": True}


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return hf_tiny_llama()


@pytest.fixture(scope="module")
def server(hf_model: Any) -> Iterator[tuple[str, LLMEngine]]:
    engine = tiny_engine(hf_model, num_blocks=1024, max_model_len=CONTEXT, max_num_batched_tokens=2048)
    assert engine.max_model_len == CONTEXT
    with running_server(AsyncEngine(engine)) as base:
        yield base, engine


def _post(base: str, path: str, body: object) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=120)


def hf_logprobs(hf: Any, prompt: list[int], labels: list[list[int]]) -> list[float]:
    """Each label's whole-sequence log-probability after `prompt` (teacher forced)."""
    lps = []
    with torch.no_grad():
        for label in labels:
            lp = torch.log_softmax(hf(torch.tensor([prompt + label])).logits[0].float(), -1)
            lps.append(sum(lp[len(prompt) - 1 + k, t].item() for k, t in enumerate(label)))
    return lps


def hf_probabilities(hf: Any, prompt: list[int], labels: list[list[int]]) -> list[float]:
    """Softmax over the labels' whole-sequence log-probabilities after `prompt`."""
    return torch.softmax(torch.tensor(hf_logprobs(hf, prompt, labels), dtype=torch.float64), 0).tolist()


def _answer_probabilities(answer: dict[str, Any]) -> list[float]:
    if answer["type"] == "predicate":
        return [answer["probability"], 1 - answer["probability"]]
    return [p["probability"] for p in answer["probabilities"]]


def _check_against_hf(hf: Any, answers: list[dict[str, Any]]) -> None:
    for answer in answers:
        lps = hf_logprobs(hf, answer["prompt_token_ids"], answer["label_token_ids"])
        assert answer["label_logprobs"] == pytest.approx(lps, abs=TOL)  # what the refusal rule reads
        ref = torch.softmax(torch.tensor(lps, dtype=torch.float64), 0).tolist()
        assert _answer_probabilities(answer) == pytest.approx(ref, abs=TOL)


def test_openai_client_sync_parses_and_matches_transformers(server, hf_model) -> None:  # noqa: ANN001
    base, engine = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    decision = client.decisions.create(model="tiny-llama", input=INPUT, questions=QUESTIONS, extra_body=ANSWERED)
    types = [type(a).__name__ for a in decision.answers]
    assert types == ["AnswerAnswerResourcePredicate", "AnswerAnswerResourceChoice", "AnswerAnswerResourceChoice",
                     "AnswerAnswerResourceChoice", "AnswerAnswerResourceScore"]
    assert [a.name for a in decision.answers] == ["refund", "letter", None, "typed", "urgency"]
    raw = [a.model_dump() for a in decision.answers]
    _check_against_hf(hf_model, raw)
    # one-token letters are read at the question's end; the other options are scored whole
    assert [len(t) for t in raw[1]["label_token_ids"]] == [1, 1, 1]
    assert raw[0]["label_token_ids"] == [list(b"Yes"), list(b"No")]
    # "bill" begins "billing": every option of that question ends with the end of turn
    assert all(t[-1] == EOS for t in raw[2]["label_token_ids"])
    typed = decision.answers[3]
    assert [p.value for p in typed.probabilities] == [True, "true", False]
    assert [type(p.value) for p in typed.probabilities] == [bool, str, bool]
    assert raw[3]["label_token_ids"][0] == list(b"true") and raw[3]["label_token_ids"][1] == list(b'"true"')
    score = decision.answers[4]
    probs = [p.probability for p in score.probabilities]
    assert [p.value for p in score.probabilities] == [0, 1, 2]
    assert [p.label for p in score.probabilities] == ["low", "mid", "high"]
    assert score.score == pytest.approx(sum(i * p for i, p in enumerate(probs)))
    assert score.confidence == pytest.approx(max(probs))
    for a in decision.answers[1:4]:
        best = max(a.probabilities, key=lambda p: p.probability)
        assert a.choice == best.value and a.confidence == pytest.approx(best.probability)
        assert math.fsum(p.probability for p in a.probabilities) == pytest.approx(1.0)
    usage = decision.usage
    assert usage.output_tokens == 0 and usage.total_tokens == usage.input_tokens > 0
    engine.check_integrity()


def test_openai_client_async_and_the_input_cached_for_the_next_request(server) -> None:  # noqa: ANN001
    base, _ = server
    messages = [{"role": "system", "content": "You sort tickets."},
                {"role": "user", "content": [{"type": "input_text", "text": "Ticket:"},
                                             {"type": "input_json", "data": {"id": 7, "body": "refund please"}}]},
                {"role": "assistant", "content": "Noted."}, {"role": "developer", "content": "Be strict."}]

    async def ask() -> list[Any]:
        # closed in this loop: a client left to the garbage collector closes its connection
        # on whichever test's event loop runs then
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused") as client:
            first = await client.decisions.create(model="tiny-llama", input=messages, questions=QUESTIONS[:2],
                                                  prompt_cache_key="tickets", extra_body=ANSWERED)
            second = await client.decisions.create(model="tiny-llama", input=messages, questions=QUESTIONS[2:],
                                                   extra_body=ANSWERED)
        return [first, second]

    first, second = asyncio.run(ask())
    assert [a.type for a in first.answers + second.answers] == ["predicate", "choice", "choice", "choice", "score"]
    prompt = first.answers[0].model_dump()["prompt_token_ids"]
    text = bytes(t for t in prompt if t < 256).decode()
    assert '{"id":7,"body":"refund please"}' in text and "<system>Be strict." in text  # developer: a system turn
    # the second request about the same input reads it from the prefix cache (whole blocks of 4)
    prompts = [a.model_dump()["prompt_token_ids"] for a in second.answers]
    shared = next(i for i in range(len(prompts[0])) if len({tuple(p[: i + 1]) for p in prompts}) > 1)
    assert bytes(prompts[0][:shared]).decode().endswith("<assistant>Noted.<system>Be strict.<user>")
    rendered_input = shared - len(b"<user>")
    # each of the second request's three rows reads the input's whole blocks from the cache
    assert second.usage.input_tokens_details.cached_tokens >= 3 * ((rendered_input // 4) * 4 - 4) > 0


def test_packed_and_one_by_one_give_equal_answers(server, hf_model) -> None:  # noqa: ANN001
    base, _ = server
    body = {"input": INPUT, "questions": QUESTIONS, **ANSWERED}
    packed, alone = _post(base, "/v1/decisions", body), _post(base, "/v1/decisions", {**body, "multi_item": False})
    assert packed.status_code == 200 and alone.status_code == 200, packed.text + alone.text
    for a, b in zip(packed.json()["answers"], alone.json()["answers"]):
        assert a["prompt_token_ids"] == b["prompt_token_ids"] and a["label_token_ids"] == b["label_token_ids"]
        assert _answer_probabilities(a) == pytest.approx(_answer_probabilities(b), abs=1e-5)
    _check_against_hf(hf_model, alone.json()["answers"])


def test_the_input_is_computed_once_for_all_rows(server) -> None:  # noqa: ANN001
    base, _ = server
    fresh = "A brand new input nobody has asked about before, long enough for several blocks."
    r = _post(base, "/v1/decisions", {"input": fresh, "questions": QUESTIONS, **ANSWERED})
    assert r.status_code == 200, r.text
    prompts = [a["prompt_token_ids"] for a in r.json()["answers"]]
    shared = next(i for i in range(len(prompts[0])) if len({tuple(p[: i + 1]) for p in prompts}) > 1)
    # one row packs the one-token question; each other question's row (its options scored
    # whole after it) reads the input's blocks: riding the leader's step, or from the cache
    # when it reached the engine after that step was planned
    whole_label_rows = sum(any(len(t) > 1 for t in a["label_token_ids"]) for a in r.json()["answers"])
    assert whole_label_rows == 4
    cached = r.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= whole_label_rows * ((shared // 4) * 4 - 4) > 0


def test_more_questions_than_one_row_holds_are_split_without_changing_answers(server, hf_model) -> None:  # noqa: ANN001
    base, engine = server
    questions = [{"type": "choice", "instructions": f"Question {i}: pick one.",
                  "choices": [{"value": "a"}, {"value": "b"}]} for i in range(14)]
    questions += [{"type": "predicate", "instructions": f"Claim {i} holds."} for i in range(4)]
    body = {"input": INPUT, "questions": questions, **ANSWERED}
    packed = _post(base, "/v1/decisions", body)
    assert packed.status_code == 200, packed.text
    answers = packed.json()["answers"]
    rows_tokens = packed.json()["usage"]["input_tokens"]
    assert rows_tokens > CONTEXT  # more than one row's context: several rows
    alone = _post(base, "/v1/decisions", {**body, "multi_item": False}).json()["answers"]
    for a, b in zip(answers, alone):
        assert _answer_probabilities(a) == pytest.approx(_answer_probabilities(b), abs=1e-5)
    _check_against_hf(hf_model, [answers[0], answers[13], answers[-1]])
    engine.check_integrity()


def test_options_longer_than_one_row_are_split_without_changing_answers(server, hf_model) -> None:  # noqa: ANN001
    base, engine = server
    values = [f"option number {i:02d} ok" for i in range(12)]  # 12 x 19 option tokens: more than a row holds
    question = {"type": "choice", "instructions": "Pick one.", "choices": [{"value": v} for v in values]}
    body = {"input": INPUT, "questions": [question], **ANSWERED}
    r = _post(base, "/v1/decisions", body)
    assert r.status_code == 200, r.text
    answer = r.json()["answers"][0]
    assert len(answer["prompt_token_ids"]) + sum(map(len, answer["label_token_ids"])) > CONTEXT
    lps = hf_logprobs(hf_model, answer["prompt_token_ids"], answer["label_token_ids"])
    assert answer["label_logprobs"] == pytest.approx(lps, abs=TOL)
    engine.check_integrity()


def test_refusal_below_the_threshold(server) -> None:  # noqa: ANN001
    base, _ = server
    # random weights spread the probability over the whole vocabulary: the options hold little
    r = _post(base, "/v1/decisions", {"input": INPUT, "questions": QUESTIONS, "refusal_threshold": 0.5})
    assert r.status_code == 200, r.text
    answers = r.json()["answers"]
    assert answers == [{"type": "refusal", "name": q.get("name")} for q in QUESTIONS]
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    parsed = client.decisions.create(model="tiny-llama", input=INPUT, questions=QUESTIONS[:1],
                                     extra_body={"refusal_threshold": 0.5})
    assert type(parsed.answers[0]).__name__ == "AnswerAnswerResourceRefusal"
    kept = _post(base, "/v1/decisions", {"input": INPUT, "questions": QUESTIONS[:1], "refusal_threshold": 0})
    assert kept.json()["answers"][0]["type"] == "predicate"


def _q(**fields: Any) -> dict[str, Any]:
    return {"type": "choice", "instructions": "Pick.", "choices": [{"value": "a"}, {"value": "b"}], **fields}


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": INPUT, "questions": []}, "questions"),
    ({"input": INPUT, "questions": [_q()] * 401}, "questions"),
    ({"input": INPUT, "questions": [_q(choices=[{"value": "a"}])]}, "questions.0.choices"),
    ({"input": INPUT, "questions": [_q(choices=[{"value": f"v{i}"} for i in range(256)])]}, "questions.0.choices"),
    ({"input": INPUT, "questions": [_q(choices=[{"value": "a"}, {"value": "a"}])]}, "questions.0.choices.1.value"),
    ({"input": INPUT, "questions": [_q(choices=[{"value": True}, {"value": True}])]}, "questions.0.choices.1.value"),
    ({"input": INPUT, "questions": [{"type": "score", "instructions": "Rate.", "levels": [{"label": "x"}]}]},
     "questions.0.levels"),
    ({"input": INPUT, "questions": [{"type": "score", "instructions": "Rate.",
                                     "levels": [{"label": str(i)} for i in range(11)]}]}, "questions.0.levels"),
    ({"input": INPUT, "questions": [{"type": "ranking", "instructions": "Rank."}]}, "questions.0.type"),
    ({"input": INPUT, "questions": [_q(colour="red")]}, "questions.0.colour"),
    ({"input": INPUT, "questions": [_q(choices=[{"value": "a", "weight": 2}, {"value": "b"}])]},
     "questions.0.choices.0.weight"),
    ({"input": INPUT, "questions": [_q()], "temperature": 0}, "temperature"),
    ({"input": INPUT, "questions": [_q(instructions="")]}, "questions.0.instructions"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}],
      "questions": [_q()]}, "input.0.content.0"),
    ({"input": [{"role": "tool", "content": "x"}], "questions": [_q()]}, "input.0.role"),
    ({"input": "", "questions": [_q()]}, "input"),
    ({"input": "x" * 1100, "questions": [_q()]}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, body: dict[str, Any], param: str) -> None:  # noqa: ANN001
    base, _ = server
    r = _post(base, "/v1/decisions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_request_size_limit_counts_the_input_once(hf_model) -> None:  # noqa: ANN001
    from prelude.entrypoints.openai.limits import ServerLimits

    long_input = "The quick brown fox jumps over the lazy dog. " * 6  # ~280 tokens, in every row
    questions = [{"type": "predicate", "instructions": f"Claim {i}."} for i in range(4)]  # a row each (Yes: 3 bytes)
    engine = tiny_engine(hf_model, num_blocks=512, max_model_len=CONTEXT, max_num_batched_tokens=2048)
    with running_server(AsyncEngine(engine), limits=ServerLimits(max_request_tokens=800)) as base:
        ok = _post(base, "/v1/decisions", {"input": long_input, "questions": questions})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["input_tokens"] > 800  # the rows' prompts hold the input four times
        big = _post(base, "/v1/decisions", {"input": long_input, "questions": questions * 5})
        assert big.status_code == 400 and big.json()["error"]["param"] == "questions", big.text


def test_a_model_without_chat_template_is_a_400(hf_model) -> None:  # noqa: ANN001
    from tests.engine.tiny import ByteTokenizer

    class Plain(ByteTokenizer):
        chat_template = None

        def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, **kw: Any) -> str:
            raise ValueError("this model has no chat template")

    engine = tiny_engine(hf_model, num_blocks=64, max_model_len=256, tokenizer=Plain())
    with running_server(AsyncEngine(engine)) as base:
        r = _post(base, "/v1/decisions", {"input": INPUT, "questions": [_q()]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        r = _post(base, "/v1/systemone", {"state": INPUT, "questions": {"q": {"type": "noul", "instructions": "x"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_systemone_round_trip_reads_what_decisions_reads(server, hf_model) -> None:  # noqa: ANN001
    base, _ = server
    body = {"model": "tiny-llama", "state": INPUT, "return_prompt_token_ids": True, "questions": {
        "refund": {"type": "noul", "instructions": "The customer asks for a refund."},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "shipping": None}},
        "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["can wait", "today"]},
    }}
    r = _post(base, "/v1/systemone", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "tiny-llama" and set(out["usage"]) == {"input_tokens", "output_tokens"}
    answers = out["answers"]
    assert list(answers) == ["refund", "team", "urgency"]
    assert answers["refund"]["type"] == "noul" and 0 <= answers["refund"]["noul"] <= 1
    team = answers["team"]
    assert team["type"] == "choice" and set(team["probabilities"]) == {"billing", "shipping"}
    assert team["choice"] == max(team["probabilities"], key=team["probabilities"].get)
    urgency = answers["urgency"]
    assert urgency["legend"] == {"0": "can wait", "1": "today"} and set(urgency["probabilities"]) == {"0", "1"}
    assert urgency["score"] == pytest.approx(urgency["probabilities"]["1"])
    for a in answers.values():
        probs = [a["noul"], 1 - a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values())
        assert probs == pytest.approx(hf_probabilities(hf_model, a["prompt_token_ids"], a["label_token_ids"]),
                                      abs=TOL)
    # a noul is asked as OpenAI's predicate: the same prompt, the same probability
    same = _post(base, "/v1/decisions", {"input": INPUT, "questions": [QUESTIONS[0]], **ANSWERED}).json()
    assert same["answers"][0]["probability"] == pytest.approx(answers["refund"]["noul"], abs=1e-6)
    bad = _post(base, "/v1/systemone", {"state": INPUT, "questions": {"q": {"type": "score", "instructions": "x",
                                                                             "criteria": ["only one"]}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "questions.q.criteria"


def test_metrics_count_decisions_and_questions(server) -> None:  # noqa: ANN001
    base, _ = server
    before = httpx.get(base + "/metrics").text
    assert _post(base, "/v1/decisions", {"input": INPUT, "questions": QUESTIONS, "refusal_threshold": 0.5}
                 ).status_code == 200
    after = httpx.get(base + "/metrics").text

    def value(text: str, needle: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(needle)]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    refused = 'prelude:decision_questions_total{model_name="tiny-llama",outcome="refused",route="/v1/decisions",' \
              'type="choice"}'
    assert value(after, refused) - value(before, refused) == 3
    requests = 'prelude:decisions_total{model_name="tiny-llama",route="/v1/decisions"}'
    assert value(after, requests) - value(before, requests) == 1


def test_batch_lines_answer_as_the_route(server, tmp_path: Path) -> None:  # noqa: ANN001
    base, engine = server
    body = {"model": "tiny-llama", "input": INPUT, "questions": QUESTIONS[:2], **ANSWERED}
    inp = write_lines(tmp_path / "in.jsonl", [
        {"custom_id": "d-1", "method": "POST", "url": "/v1/decisions", "body": body},
        {"custom_id": "d-2", "method": "POST", "url": "/v1/decisions", "body": {**body, "questions": []}},
        {"custom_id": "s-1", "method": "POST", "url": "/v1/systemone",
         "body": {"state": INPUT, "questions": {"q": {"type": "noul", "instructions": "x"}}}},
    ])
    front = AsyncEngine(tiny_engine(hf_tiny_llama(), num_blocks=1024, max_model_len=CONTEXT,
                                    max_num_batched_tokens=512))
    try:
        asyncio.run(run_job(front, inp, tmp_path / "out.jsonl", JobOptions(max_inflight=4)))
    finally:
        front.shutdown()
    lines = {line["custom_id"]: line for line in read_output(tmp_path / "out.jsonl")}
    served = _post(base, "/v1/decisions", body).json()
    assert lines["d-1"]["response"]["status_code"] == 200
    for a, b in zip(lines["d-1"]["response"]["body"]["answers"], served["answers"]):
        assert _answer_probabilities(a) == pytest.approx(_answer_probabilities(b), abs=1e-5)
    assert lines["d-2"]["response"]["status_code"] == 400
    assert lines["d-2"]["response"]["body"]["error"]["param"] == "questions"
    assert lines["s-1"]["response"]["body"]["answers"]["q"]["type"] == "noul"
