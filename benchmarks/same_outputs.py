"""Old vs new, answer for answer: every served architecture's greedy tokens, their logprobs,
one-token judge answers, embeddings and classifier scores, computed by two checkouts in
turn (each in a process of its own, its src/ first on the path) and compared exactly.

    python -m benchmarks.same_outputs --old /path/to/old/checkout [--dtype bfloat16 float32]

The checkpoints are random-weight Llama, Mistral, Qwen2 and Qwen3 folders written once
(the default model's tokenizer beside them), the default model itself (its GGUF blocks
included) and the embedded all-MiniLM-L6-v2. Exit 0 when every answer is bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Write a haiku about the sea.\n",
           "Q: What is 17 * 23?\nA:", "def fibonacci(n):\n    "]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _write_checkpoints(folder: Path) -> list[Path]:
    """Random-weight folders of each family with the default model's tokenizer."""
    import torch
    import transformers

    from prelude.model.loading.files import converted_gguf_dir, default_model_path

    tokenizer_dir = converted_gguf_dir(default_model_path())
    shape = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    made = []
    for family in FAMILIES:
        target = folder / family
        if not (target / "config.json").exists():
            torch.manual_seed(len(family))
            config, model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
            extra: dict[str, Any] = {"head_dim": 32} if family == "qwen3" else {}
            hf = model(config(**shape, **extra, tie_word_embeddings=family == "qwen2"))
            with torch.no_grad():
                for name, p in hf.named_parameters():
                    if "norm" in name or name.endswith("bias"):
                        p.add_(torch.randn_like(p) * 0.1)
            hf.save_pretrained(target)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tokenizer_dir / name, target / name)
        made.append(target)
    return made


def _answers(models: list[str], dtype: str) -> dict[str, Any]:
    """What this checkout answers (runs inside the checkout's process)."""
    from prelude import LLM, SamplingParams
    from prelude.params import PoolingParams, PoolingTask

    out: dict[str, Any] = {}
    for model in models:
        llm = LLM(model=model or None, dtype=dtype, num_kv_blocks=512, max_num_seqs=8)
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
        judge = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        key = Path(model).name if model else "default"
        for what, params in (("greedy", greedy), ("judge", judge)):
            results = llm.generate(PROMPTS, params)
            out[f"{key}/{dtype}/{what}"] = [
                [r.outputs[0].token_ids, [[step.token_id, step.logprob, [list(t) for t in step.top]]
                                          for step in (r.outputs[0].logprobs or [])]]
                for r in results]
        del llm
    from prelude.engine.engine import LLMEngine
    from prelude.config import EngineConfig, ExecutorConfig, CacheConfig

    engine = LLMEngine.from_config(EngineConfig(model="all-MiniLM-L6-v2", executor=ExecutorConfig(dtype=dtype),
                                                cache=CacheConfig(num_blocks=64)))
    ids = [engine.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    for i, prompt in enumerate(ids):
        engine.add_request(f"e{i}", prompt, SamplingParams(max_tokens=1),
                           PoolingParams(task=PoolingTask.EMBED, normalize=True))
    vectors: dict[str, Any] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.embedding is not None:
                vectors[o.request_id] = list(o.embedding)
    out[f"minilm/{dtype}/embed"] = [vectors[f"e{i}"] for i in range(len(ids))]
    return out


def _run_checkout(checkout: Path, models: list[str], dtype: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout / "src"), str(ROOT)]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    code = (f"import json, sys; from benchmarks.same_outputs import _answers; "
            f"json.dump(_answers({models!r}, {dtype!r}), open({path!r}, 'w'))")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(checkout))
    return json.loads(Path(path).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the other checkout (its src/ is imported)")
    parser.add_argument("--new", type=Path, default=ROOT)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "prelude-same-outputs")
    args = parser.parse_args()
    models = [""] + [str(p) for p in _write_checkpoints(args.folder)]
    differ = 0
    for dtype in args.dtype:
        old = _run_checkout(args.old, models, dtype)
        new = _run_checkout(args.new, models, dtype)
        for key in sorted(old):
            same = old[key] == new.get(key)
            differ += not same
            print(f"{key:32} {'identical' if same else 'DIFFERENT'}")
    print(f"{differ} of {len(args.dtype) * (len(models) * 2 + 1)} answer sets differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
