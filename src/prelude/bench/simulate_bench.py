"""`prelude bench simulate`: plan past one machine by simulation.

Replays synthetic traces against 1 to 64 simulated instances (cluster/simulate.py)
whose step costs come from T(L, H) fitted on this machine's engine (`--fit`, or a
saved `--cost-file`). Compares, at each instance count:
- colocated vs disaggregated prefill/decode (Prophet), on a long/short mix;
- uniform vs LAPS short/long pools, on the same mix;
- round-robin vs prefix routing, on a shared-prefix trace.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from prelude.bench.results import write_json
from prelude.cluster.pools import PoolConfig
from prelude.cluster.router import RouterConfig
from prelude.cluster.simulate import SimConfig, Simulator, StepCost, synthetic_trace

log = logging.getLogger("prelude.bench.simulate")


def fit_step_cost(model: str | None, threads: int | None, dtype: str = "auto") -> tuple[StepCost, list[Any]]:
    """Time real engine steps (prefills of L tokens; decode batches of B rows at context H)
    and fit T(L, H). Returns the fit and the samples."""
    import torch

    from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, SchedulerConfig
    from prelude.engine.engine import LLMEngine
    from prelude.engine.request import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    engine = LLMEngine.from_config(EngineConfig(
        model=model, executor=ExecutorConfig(device="cpu", dtype=dtype),
        cache=CacheConfig(enable_prefix_caching=False, kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64),
    ))
    vocab = engine.info.vocab_size
    samples: list[tuple[list[tuple[int, int]], float]] = []
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    rid = 0

    def timed_step() -> float:
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0

    engine.add_request("warm", [5] * 64, params)
    while engine.has_unfinished():
        engine.step()
    for L in (32, 128, 512):
        for _ in range(1):
            rid += 1
            engine.add_request(f"p{rid}", [(7 * i + rid) % vocab for i in range(L)], params)
            samples.append(([(L, 0)], timed_step()))  # the prefill
            samples.append(([(1, L)], timed_step()))  # one decode row at context L
            while engine.has_unfinished():
                engine.step()
            log.warning("fit: prefill of %d tokens took %.3f s", L, samples[-2][1])
    for B, H in ((8, 128), (16, 256)):
        for j in range(B):
            rid += 1
            engine.add_request(f"d{rid}", [(3 * i + rid) % vocab for i in range(H)], SamplingParams(
                max_tokens=4, temperature=0, ignore_eos=True))
        started: set[str] = set()  # every request has its first token: the next step is pure decode
        while len(started) < B:
            started.update(out.request_id for out in engine.step())
        samples.append(([(1, H + 1)] * B, timed_step()))
        while engine.has_unfinished():
            engine.step()
    return StepCost.fit(samples), samples


def _scenarios(n: int, short_pool: int) -> dict[str, SimConfig]:
    ll = RouterConfig(policy="least_load")
    d = max(1, n * 3 // 8)
    return {
        "colocated": SimConfig(instances=n, router=ll),
        "disaggregated": SimConfig(instances=n, mode="disaggregated", decode_instances=d, router=ll,
                                   prefill_policy="srpt"),
        "uniform_pools": SimConfig(instances=n, router=ll),
        "laps_pools": SimConfig(instances=n, router=ll, laps_pools=(short_pool, n - short_pool)),
        "round_robin": SimConfig(instances=n, router=RouterConfig(policy="round_robin")),
        "prefix": SimConfig(instances=n, router=RouterConfig(policy="prefix")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prelude bench simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", default="8,64", help="comma-separated instance counts (1 to 64)")
    p.add_argument("--requests-per-instance", type=int, default=150)
    p.add_argument("--rate-per-instance", type=float, default=None,
                   help="arrivals per second per instance (default: 70%% of one instance's fitted capacity)")
    p.add_argument("--fit", action="store_true", help="fit T(L, H) on this machine's engine now")
    p.add_argument("--model", default=None, help="model for --fit (default: the embedded one)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for --fit")
    p.add_argument("--dtype", default="auto", help="model dtype for --fit")
    p.add_argument("--cost-file", default="bench_results/step_cost.json", help="where the fit is saved / read")
    p.add_argument("--laps-boundary", type=int, default=512)
    p.add_argument("--short-slo-s", type=float, default=None, help="TTFT SLO of short prompts (default: 10 x its prefill)")
    p.add_argument("--long-slo-s", type=float, default=None, help="TTFT SLO of long prompts (default: 10 x its prefill)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results/simulate.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    cost_path = Path(args.cost_file)
    if args.fit or not cost_path.exists():
        cost, samples = fit_step_cost(args.model, args.threads, args.dtype)
        cost_path.parent.mkdir(parents=True, exist_ok=True)
        cost_path.write_text(json.dumps({"cost": asdict(cost), "samples": samples}, indent=1))
    else:
        cost = StepCost(**json.loads(cost_path.read_text())["cost"])
    print(f"T(L, H) = {cost.a:.3g}*L(L+2H) + {cost.b:.3g}*L + {cost.g:.3g}*H + {cost.c:.3g}  [s]")

    short_len, long_len, out_len = (32, 256), (1024, 3072), (32, 256)
    mean_prefill = 0.8 * cost.prefill_seconds(144) + 0.2 * cost.prefill_seconds(2048)
    mean_decode = 144 * cost.seconds([(1, 512)] * 16) / 16  # per request, at a batch of 16
    capacity = 1.0 / (mean_prefill + mean_decode)
    rate = args.rate_per_instance or 0.7 * capacity
    short_slo = args.short_slo_s or 10 * cost.prefill_seconds(256)
    long_slo = args.long_slo_s or 10 * cost.prefill_seconds(3072)
    print(f"one instance ~{capacity:.2f} req/s; rate {rate:.2f} req/s per instance; "
          f"TTFT SLO short {short_slo:.2f} s, long {long_slo:.2f} s")

    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in args.instances.split(",")):
        if not 1 <= n <= 64:
            raise SystemExit("--instances must be between 1 and 64")
        count = args.requests_per_instance * n
        mix = synthetic_trace(count, rate * n, seed=args.seed, short_len=short_len, long_len=long_len,
                              output_len=out_len, short_slo_s=short_slo, long_slo_s=long_slo)
        shared = synthetic_trace(count, rate * n, seed=args.seed, short_len=(300, 700), long_fraction=0.0,
                                 output_len=out_len, shared_prefixes=2 * n, prefix_len=256,
                                 short_slo_s=short_slo, long_slo_s=long_slo)
        # Pressure in units of each pool's TTFT SLO: queued seconds per instance / SLO.
        pool_cfg = PoolConfig(boundary=args.laps_boundary, short_scale=short_slo, long_scale=long_slo,
                              min_pressure=0.1, cooldown_s=5 * cost.prefill_seconds(2048))
        for name, cfg in _scenarios(n, max(1, n // 2)).items():
            if name == "uniform_pools":
                continue  # the same run as "colocated": every instance takes every prompt
            if n < 2 and name in ("disaggregated", "laps_pools"):
                continue
            cfg = replace(cfg, pool_config=pool_cfg)
            trace = shared if name in ("round_robin", "prefix") else mix
            t0 = time.perf_counter()
            result = Simulator(cfg, cost).run(trace)
            rows.append({"instances": n, "scenario": name, **result.summary(),
                         "sim_wall_s": time.perf_counter() - t0})
    cols = ["instances", "scenario", "ttft_p90_s", "short_ttft_p90_s", "ttft_p99_s", "tpot_p99_s",
            "slo_violations", "prefix_hit_rate", "throughput_tok_s", "pool_moves", "backpressure_waits"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    write_json(args.out, {"cost": asdict(cost), "rate_per_instance": rate, "short_slo_s": short_slo,
                          "long_slo_s": long_slo, "rows": rows})
    print(f"wrote {args.out}")
    return 0
