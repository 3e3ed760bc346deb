"""LoRA adapters over HTTP: --lora-modules, load/unload routes (behind the API key),
/v1/models, the request's `model` picking the adapter on every route, 404 for unknown
names, 400 for bad adapters (the server keeps serving), load/unload while requests run."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from prelude.config import LoraConfig
from prelude.engine.async_engine import AsyncEngine
from prelude.engine.engine import LLMEngine
from prelude.engine.request import SamplingParams
from tests.engine.test_lora_engine import save_adapter
from tests.engine.tiny import hf_tiny_llama, tiny_engine
from tests.entrypoints.conftest import running_server

pytest.importorskip("peft")

KEY = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("lora-http")
    return {name: (root / name, save_adapter(root / name, seed=40 + i)) for i, name in enumerate(("judge", "chat"))}


@pytest.fixture(scope="module")
def server(adapter_dirs) -> Iterator[tuple[str, LLMEngine]]:  # noqa: ANN001
    engine = tiny_engine(hf_tiny_llama(), num_blocks=256, max_model_len=256,
                         lora=LoraConfig(max_loras=2, max_lora_rank=8))
    with running_server(AsyncEngine(engine), api_key="sekret",
                        lora_modules=[("judge", str(adapter_dirs["judge"][0]))]) as base:
        yield base, engine


def post(base: str, path: str, body: Any, headers: dict[str, str] = KEY) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=headers, timeout=60)


def greedy_text(model: Any, prompt: str, max_tokens: int) -> str:
    """What an engine on `model`'s own weights generates (the reference for an adapter)."""
    engine = tiny_engine(model)
    engine.add_request("r", list(prompt.encode()), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return engine.tokenizer.decode(tokens)


def completion(base: str, model: str | None, prompt: str = "adapters!", max_tokens: int = 5) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return post(base, "/v1/completions", body if model is None else {**body, "model": model})


def test_models_list_adapters_with_their_parent(server) -> None:  # noqa: ANN001
    base, engine = server
    data = httpx.get(base + "/v1/models", headers=KEY).json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(engine.model_name, None), ("judge", engine.model_name)]


def test_the_model_field_picks_the_adapter(server, adapter_dirs) -> None:  # noqa: ANN001
    base, engine = server
    got = completion(base, "judge").json()
    assert got["model"] == "judge"
    assert got["choices"][0]["text"] == greedy_text(adapter_dirs["judge"][1], "adapters!", 5)
    base_answer = completion(base, engine.model_name).json()
    assert base_answer["choices"][0]["text"] == greedy_text(hf_tiny_llama(), "adapters!", 5)
    assert base_answer["choices"][0]["text"] != got["choices"][0]["text"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/embeddings", {"input": "hello"}),
    ("/v1/score", {"text_1": "q", "text_2": ["a", "b"]}),
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
    ("/v1/reward", {"input": "hello"}),
    ("/classify", {"input": "x", "labels": ["ab", "cd"]}),
    ("/tokenize", {"prompt": "hi"}),
    ("/v1/decisions", {"input": "x", "questions": [{"type": "predicate", "instructions": "y"}]}),
])
def test_every_route_takes_adapter_names_and_refuses_unknown_ones(server, path: str, body: dict) -> None:  # noqa: ANN001
    base, _ = server
    unknown = post(base, path, {**body, "model": "nope"})
    assert unknown.status_code == 404
    err = unknown.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error" and "judge" in err["message"]
    with_adapter = post(base, path, {**body, "model": "judge"})
    assert with_adapter.status_code != 404, with_adapter.text
    if with_adapter.status_code == 200 and path != "/tokenize":
        assert with_adapter.json().get("model") == "judge"


def test_embeddings_use_the_adapter(server, adapter_dirs) -> None:  # noqa: ANN001
    base, _ = server
    got = post(base, "/v1/embeddings", {"input": "hello", "model": "judge"}).json()["data"][0]["embedding"]
    plain = post(base, "/v1/embeddings", {"input": "hello"}).json()["data"][0]["embedding"]
    assert got != plain


def test_decisions_read_the_adapter(server, adapter_dirs) -> None:  # noqa: ANN001
    from tests.entrypoints.test_decisions import hf_probabilities

    base, _ = server
    body = {"input": "hello", "return_prompt_token_ids": True, "questions": [
        {"type": "choice", "instructions": "Pick.", "choices": [{"value": "a"}, {"value": "b"}, {"value": "c"}]},
        {"type": "predicate", "instructions": "It is a greeting."}]}
    got = post(base, "/v1/decisions", {**body, "model": "judge"}).json()
    plain = post(base, "/v1/decisions", body).json()
    merged = adapter_dirs["judge"][1]
    for a, b in zip(got["answers"], plain["answers"]):
        probs = [p["probability"] for p in a["probabilities"]] if a["type"] == "choice" else \
            [a["probability"], 1 - a["probability"]]
        assert probs == pytest.approx(hf_probabilities(merged, a["prompt_token_ids"], a["label_token_ids"]), abs=1e-4)
        assert a != b
    assert got["model"] == "judge"


def test_load_and_unload_need_the_api_key(server, adapter_dirs) -> None:  # noqa: ANN001
    base, _ = server
    body = {"lora_name": "x", "lora_path": str(adapter_dirs["chat"][0])}
    assert post(base, "/v1/load_lora_adapter", body, headers={}).status_code == 401
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "judge"}, headers={}).status_code == 401


def _bad_adapters(root: Path, good: Path) -> list[tuple[str, str, str]]:
    """(name, path, what the message says) for each way an adapter can be bad."""

    cases = [("missing", str(root / "nothing-here"), "not a directory")]
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(good / "adapter_config.json", no_weights)
    cases.append(("no-weights", str(no_weights), "lacks adapter_model.safetensors"))
    wrong = root / "wrong-shape"
    save_adapter(wrong, seed=1)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    cases.append(("wrong-shape", str(wrong), "do not fit"))
    big = root / "big-rank"
    save_adapter(big, seed=2, r=16)
    cases.append(("big-rank", str(big), "over --max-lora-rank 8"))
    target = root / "bad-target"
    shutil.copytree(good, target)
    cfg = json.loads((target / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "lm_head"]
    (target / "adapter_config.json").write_text(json.dumps(cfg))
    cases.append(("bad-target", str(target), "unknown target module"))
    for alpha in ([1], None, float("nan"), float("inf"), 0, True):  # 500s (TypeError...) or silently wrong
        odd = root / f"alpha-{alpha}"
        shutil.copytree(good, odd)
        cfg = json.loads((odd / "adapter_config.json").read_text())
        cfg["lora_alpha"] = alpha
        (odd / "adapter_config.json").write_text(json.dumps(cfg))
        cases.append((f"alpha-{alpha}", str(odd), "lora_alpha must be a positive finite number"))
    for what in ("rank-0", "scalar"):  # a ZeroDivisionError, an IndexError
        odd = root / what
        shutil.copytree(good, odd)
        tensors = load_file(str(odd / "adapter_model.safetensors"))
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        tensors[key] = torch.zeros(0, tensors[key].shape[1]) if what == "rank-0" else torch.tensor(1.0)
        save_file(tensors, str(odd / "adapter_model.safetensors"))
        cases.append((what, str(odd), "do not fit"))
    cases.append(("judge", str(good), "already loaded"))  # the name is taken
    return cases


def test_bad_adapters_get_400_and_the_server_keeps_serving(server, adapter_dirs, tmp_path: Path) -> None:  # noqa: ANN001
    base, engine = server
    for name, path, why in _bad_adapters(tmp_path, adapter_dirs["chat"][0]):
        r = post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert why in err["message"] and err["type"] == "invalid_request_error", (name, err)
        assert completion(base, "judge").status_code == 200
    names = [m["id"] for m in httpx.get(base + "/v1/models", headers=KEY).json()["data"]]
    assert names == [engine.model_name, "judge"]
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}).status_code == 404


def test_a_name_with_a_lone_surrogate_is_a_400_and_models_still_answer(server, adapter_dirs) -> None:  # noqa: ANN001
    base, engine = server
    body = '{"lora_name": "\\ud800x", "lora_path": "%s"}' % adapter_dirs["chat"][0]
    r = httpx.post(base + "/v1/load_lora_adapter", content=body,
                   headers={**KEY, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = httpx.get(base + "/v1/models", headers=KEY)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [engine.model_name, "judge"]


def test_a_loaded_adapter_whose_folder_goes_away_still_serves(server, adapter_dirs, tmp_path: Path) -> None:  # noqa: ANN001
    """Its tensors stay in host memory: reading the folder again in a step failed the step,
    the base model's requests in it too."""
    base, _ = server
    folder = tmp_path / "moving"
    shutil.copytree(adapter_dirs["chat"][0], folder)
    assert post(base, "/v1/load_lora_adapter", {"lora_name": "moving", "lora_path": str(folder)}).status_code == 200
    expected = greedy_text(adapter_dirs["chat"][1], "adapters!", 5)
    try:
        shutil.rmtree(folder)
        # a step with this adapter and the base: both answer (the slot is filled from the host copy)
        results: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda m=m: results.__setitem__(m or "base", completion(base, m)))
                   for m in ("moving", None)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["base"].status_code == 200
        assert results["moving"].status_code == 200 and results["moving"].json()["choices"][0]["text"] == expected
    finally:
        post(base, "/v1/unload_lora_adapter", {"lora_name": "moving"})


def test_load_and_unload_while_requests_run(server, adapter_dirs) -> None:  # noqa: ANN001
    base, _ = server
    want_judge = greedy_text(adapter_dirs["judge"][1], "a long one", 60)
    want_chat = greedy_text(adapter_dirs["chat"][1], "adapters!", 5)
    results: dict[str, Any] = {}
    started = threading.Event()

    def long_stream() -> None:
        body = {"prompt": "a long one", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "model": "judge",
                "stream": True}
        text = ""
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=KEY, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
                    started.set()
        results["judge"] = text

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    assert post(base, "/v1/load_lora_adapter",
                {"lora_name": "chat", "lora_path": str(adapter_dirs["chat"][0])}).status_code == 200
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "judge"}).status_code == 200
    assert completion(base, "judge").status_code == 404  # new requests no longer find it...
    assert completion(base, "chat").json()["choices"][0]["text"] == want_chat
    t.join(120)
    assert results["judge"] == want_judge  # ...the running one finished with it
    # loading the name again serves it again
    assert post(base, "/v1/load_lora_adapter",
                {"lora_name": "judge", "lora_path": str(adapter_dirs["judge"][0])}).status_code == 200
    assert completion(base, "judge", "a long one", 60).json()["choices"][0]["text"] == want_judge


def save_classifier_adapter(path: Path, num_labels: int, seed: int) -> Any:
    """A PEFT sequence-classification adapter (LoRA on all projections, its own `score`
    head in modules_to_save) over hf_tiny_llama()'s weights; returns the PEFT model."""
    import peft
    import torch
    import transformers

    causal = hf_tiny_llama()
    model = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**{**causal.config.to_dict(), "num_labels": num_labels, "pad_token_id": 0}))
    model.model.load_state_dict(causal.model.state_dict())
    cfg = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(seed)
    model = peft.get_peft_model(model.float().eval(), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(path))
    return model.eval()


def test_an_adapter_with_its_own_head_serves_classify_and_score(server, tmp_path: Path) -> None:  # noqa: ANN001
    import math

    import torch

    base, _ = server
    models = {}
    for name, labels in (("cls3", 3), ("scorer", 1)):
        models[name] = save_classifier_adapter(tmp_path / name, labels, seed=labels)
        r = post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(tmp_path / name)})
        assert r.status_code == 200, r.text
    with torch.no_grad():
        want = torch.softmax(models["cls3"](torch.tensor([list(b"judge this")])).logits[0].float(), -1).tolist()
    got = post(base, "/classify", {"model": "cls3", "input": "judge this"}).json()
    assert got["model"] == "cls3" and got["data"][0]["num_classes"] == 3
    assert got["data"][0]["probs"] == pytest.approx(want, abs=1e-4)
    assert got["data"][0]["label"] == f"LABEL_{max(range(3), key=want.__getitem__)}"
    with torch.no_grad():
        logit = models["scorer"](torch.tensor([list(b"q\nd")])).logits[0, 0].item()
    score = post(base, "/v1/score", {"model": "scorer", "text_1": "q", "text_2": ["d"]}).json()
    assert score["data"][0]["score"] == pytest.approx(1 / (1 + math.exp(-logit)), abs=1e-4)
    # the base (no head) still refuses /classify without labels
    assert post(base, "/classify", {"input": "judge this"}).status_code == 400
    for name in models:
        assert post(base, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
