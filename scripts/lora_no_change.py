"""No adapter loaded vs main: the decoder forward before LoRA (99c8555's loop, copied here) vs
now (lora=None): same runner, same 4-row decode batch, alternated, medians; and the profiler's op
counts of both. Run from the repository root: python -m scripts.lora_no_change [dtype] [trials]"""
import statistics, sys, time, types
import torch
from benchmarks.lora import _runner, _batches
from prelude.model.layers.decoder_segments import EAGER_SEGMENTS

def old_forward(self, input_ids, positions, meta, kv_caches, token_type_ids=None, segments=EAGER_SEGMENTS):
    h = self.embed.index_select(0, input_ids)
    cos, sin = self.rope.tables(positions)
    layers = self.layers
    q, k, v = segments.first(self.shape, h, layers[0].head, cos, sin)
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches, strict=True)):
        attn = self.attention.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        if i + 1 < len(layers):
            h, q, k, v = segments.between(self.shape, h, attn, layer.tail, layers[i + 1].head, cos, sin)
        else:
            h = segments.last(self.shape, h, attn, layer.tail, self.norm)
    return h

torch.set_num_threads(1)
runner, config = _runner(None, sys.argv[1] if len(sys.argv) > 1 else "auto", None, 16)
batches, blocks = _batches(4, 256, 128, 16, [None])
runner.allocate_kv_cache(blocks)
model = runner.model
inputs = runner.inputs.paged(batches["decode-base"].rows)
segs = runner._lora_forward.keywords.get("segments", EAGER_SEGMENTS) if hasattr(runner._lora_forward, "keywords") else EAGER_SEGMENTS
new = lambda: model.forward(inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, segments=segs)
old = lambda: torch.inference_mode()(old_forward)(model, inputs.input_ids, inputs.positions, inputs.meta, runner.kv_caches, segments=segs)
assert torch.equal(new(), old())
from torch.profiler import profile
counts = {}
for name, fn in (("old", old), ("new", new)):
    with profile() as prof:
        fn()
    counts[name] = sorted((e.key, e.count) for e in prof.key_averages())
print("profiler ops equal:", counts["old"] == counts["new"], sum(c for _, c in counts["new"]), "ops")
times = {"old": [], "new": []}
for _ in range(3): old(); new()
for t in range(int(sys.argv[2]) if len(sys.argv) > 2 else 60):
    for name in (("old", "new") if t % 2 == 0 else ("new", "old")):
        fn = old if name == "old" else new
        t0 = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t0)
m = {k: 1000 * statistics.median(v) for k, v in times.items()}
print(f"decode forward, 4 rows, {model.dtype}: old {m['old']:.2f} ms, new {m['new']:.2f} ms, new/old {m['new']/m['old']:.3f}; loadavg {open('/proc/loadavg').read().split()[:3]}")
