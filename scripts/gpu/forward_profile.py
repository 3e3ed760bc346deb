"""Where GPU time goes, in-process (no server): `python3 scripts/gpu/forward_profile.py [a] [c] [b]` on a CUDA machine.
(Not named profile.py: a script's folder comes first on sys.path, and cProfile imports `profile`.)
a: the 0.6B 128-token forward (inputs, graph replay, eager, engine add+step) + torch profiler + cProfile;
c: 4 x 128-in/32-out decode steps; b: the 4B 32 x 512-token forward and its kernels."""
import cProfile, pstats, statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from prelude.testing.random_model import random_model_dir
from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
from prelude.engine.engine import LLMEngine
from prelude.forward_batch import OneShotBatch, OneShotRow
from prelude.params import SamplingParams

def sync(): torch.cuda.synchronize()
def med(f, n=30):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        sync(); t0 = time.perf_counter(); f(); sync(); ts.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(ts), 3)

def engine(shape, gib=4.0, **ex):
    return LLMEngine.from_config(EngineConfig(model=str(random_model_dir(shape)),
        executor=ExecutorConfig(device="cuda", attention_backend="triton", **ex),
        cache=CacheConfig(kv_cache_memory_gib=gib), scheduler=SchedulerConfig(max_model_len=2048)))

def table(p, key, n=18):
    print(p.key_averages().table(sort_by=key, row_limit=n, max_name_column_width=60))

which = sys.argv[1:] or ["a", "c", "b"]
if "a" in which:
    e = engine("qwen3-0.6b"); r = e.runner
    ids = torch.randint(0, 150000, (128,)).tolist()
    rows = [OneShotRow("f", ids, None, None)]
    inp = r.build_oneshot_inputs(rows)
    print("inputs ms", med(lambda: r.build_oneshot_inputs(rows)))
    print("forward(graph) ms", med(lambda: r.forward(inp)))
    print("full floor ms", med(lambda: r.model.compute_logits(r.trunk(OneShotBatch(tuple(rows)))[0][-1:]).argmax(-1).cpu()))
    g = r.graphs; r.graphs = None
    print("forward(eager) ms", med(lambda: r.forward(inp)))
    r.graphs = g
    def one():
        e.add_request("x", ids, SamplingParams(max_tokens=1, temperature=0))
        while e.has_unfinished(): e.step()
    print("engine E2E (add+step) ms", med(one))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(10): one()
    table(p, "self_cpu_time_total"); table(p, "self_cuda_time_total", 12)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(50): one()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    del e, r; torch.cuda.empty_cache()
if "c" in which:
    e = engine("qwen3-0.6b")
    print("overlap", e.overlap, "decode buckets", e.runner.graphs.decode_batch_sizes)
    def dec(k):
        for i in range(4):
            e.add_request(f"d{k}{i}", torch.randint(0, 150000, (128,)).tolist(), SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        ts = []
        while e.has_unfinished():
            t0 = time.perf_counter(); e.step(); ts.append(1000 * (time.perf_counter() - t0))
        return ts
    dec(0); ts = dec(1)
    print("decode step ms p50", round(statistics.median(ts), 3), "first steps", [round(t, 2) for t in ts[:4]], "n", len(ts))
    pr = cProfile.Profile(); pr.enable(); dec(2); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p: dec(3)
    table(p, "self_cuda_time_total", 15)
    del e; torch.cuda.empty_cache()
if "b" in which:
    e = engine("qwen3-4b", gib=8.0); r = e.runner
    rows = [OneShotRow(f"f{i}", torch.randint(0, 150000, (512,)).tolist(), None, None) for i in range(32)]
    print("4B 1x512 ms", med(lambda: r.trunk(OneShotBatch(tuple(rows[:1]))), 10))
    print("4B 32x512 ms", med(lambda: r.trunk(OneShotBatch(tuple(rows))), 5))
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3): r.trunk(OneShotBatch(tuple(rows)))
        sync()
    table(p, "self_cuda_time_total", 15)
