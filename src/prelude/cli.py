"""`prelude serve | run-batch | bench | tokenizer-bench` — flag names follow vLLM's where one exists."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from typing import Callable


def _process_start() -> float:
    """The perf_counter() reading when this process started (Linux /proc; else now), so
    start-to-ready includes the interpreter and the imports before this module."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks
        return time.perf_counter() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


_STARTED = _process_start()


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="fields replacing the checkpoint's config.json (vLLM's flag): e.g. '{\"is_matryoshka\": true}' "
                        "or a yes/no reranker's '{\"classifier_from_token\": [\"no\", \"yes\"]}'")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on a GPU or a CPU with AVX512-BF16/AMX, else float32 (float16: GPU only)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "cpu"],
                   help="auto (triton on CUDA when installed, cpu on the CPU, else torch) | torch (SDPA, any "
                        "device) | triton (this project's kernels, CUDA) | cpu (C paged attention; PRELUDE_CPU_ATTENTION=0 "
                        "turns it off)")
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_false",
                   help="run RMSNorm, rotary and SiLU as separate torch ops, not the fused Triton (CUDA) or C "
                        "(float32 CPU) kernels (ablation)")
    p.add_argument("--no-prune-last-layer", dest="prune_last_layer", action="store_false",
                   help="CPU: compute the last layer for every position, not only those a head reads (ablation)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                   help="CPU: one GEMM route for every row count and one attention form for every row, so a "
                        "request's greedy answer does not depend on what shares its steps (gives up the few-row decode "
                        "routes; default: on for run-batch, whose --resume then repeats a clean run, off for serve)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch independent work while the previous step runs (default: on with CUDA)")
    p.add_argument("--compile", default="off", choices=["off", "background", "ahead"],
                   help="CPU decoders: compile the layers' math with inductor, cached on disk; background: serve "
                        "eagerly until each compiled shape is ready; ahead: before ready (default off: no gain "
                        "on a CPU whose GEMMs dominate, see docs/design.md)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="memory budget of the paged KV cache (default: on CUDA what --gpu-memory-utilization "
                        "leaves after weights, activations and graphs; on the CPU 1 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the fraction of the device's memory this engine may use, KV cache included "
                        "(default 0.9, as vLLM)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached KV blocks of shared prompt prefixes (default: on)")
    p.add_argument("--prefix-cache-max-blocks", type=int, default=None,
                   help="keep at most this many unreferenced cached blocks (default: as many as fit)")
    p.add_argument("--max-recurrent-slots", type=int, default=None,
                   help="models with recurrent (linear-attention) layers: state slots at most, one per running "
                        "chat/decode request; OneShot requests hold none (default: --max-num-seqs, as memory allows)")
    p.add_argument("--state-checkpoint-stride", type=int, default=512,
                   help="models with recurrent layers: cached prefixes keep their state every this many tokens "
                        "(a multiple of --block-size), and where peers' prompts part (default: 512)")
    p.add_argument("--max-state-checkpoints", type=int, default=None,
                   help="models with recurrent layers: state checkpoint slots of the prefix cache at most "
                        "(default: a quarter of the KV memory budget; 0: no prefix caching for such models)")
    p.add_argument("--prefix-deferral", action=argparse.BooleanOptionalAction, default=True,
                   help="peers of a cold shared prefix wait one step for the request computing it")
    p.add_argument("--prefix-riders", action=argparse.BooleanOptionalAction, default=True,
                   help="OneShot peers of a cold shared prefix run in the same forward as the request computing "
                        "it, reading the blocks it writes (default: on; off: they wait the step)")
    p.add_argument("--oneshot-gather-ms", type=float, default=250.0,
                   help="a OneShot-only step waits for the rest of the burst its last step's answers bring back, "
                        "at most this long and 5%% of that step (0: never waits)")
    p.add_argument("--policy", default="fcfs",
                   help="queue order: fcfs | srpt | mlfq | laps, or a prefill+decode pair like srpt+mlfq, laps+mlfq")
    p.add_argument("--max-decode-batch", type=int, default=None,
                   help="decode slots per step; the decode policy picks who runs (default: all running)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="default TTFT target of requests")
    p.add_argument("--low-priority-step-tokens", type=int, default=128,
                   help="low-priority requests (/v1/batches lines): the most prompt tokens a step gives them "
                        "while other requests run (none while one's prompt waits); 0: no bound")
    p.add_argument("--srpt-starvation-s", type=float, default=10.0)
    p.add_argument("--mlfq-quanta", default="25,50,100,200,400")
    p.add_argument("--mlfq-starvation-steps", type=int, default=200)
    p.add_argument("--laps-boundary", default="256", help="short/long prompt boundary L_m in tokens, or 'auto'")
    p.add_argument("--laps-long-chunk", type=int, default=512)
    p.add_argument("--laps-deadline-free", action="store_true", help="LAPS token-max mode (no TTFT deadlines)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-modules", nargs="+", default=[], type=_lora_module, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served by name from the start")
    p.add_argument("--max-loras", type=int, default=None,
                   help="LoRA adapters resident at once (LRU; default 4 when --lora-modules is given, else 0: "
                        "no adapters, not even loaded at run time)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank an adapter may have")
    p.add_argument("--fuse-oneshot", action=argparse.BooleanOptionalAction, default=True,
                   help="OneShot rows ride in the Decode/Mixed forward when budgets allow; --no-fuse-oneshot: "
                        "steps alternate between OneShot and Decode/Mixed batches")
    p.add_argument("--force-paged-path", "--force-decode-path", dest="force_paged_path", action="store_true",
                   help="ablation: send every request down the Paged path (no OneShot class); "
                        "--force-decode-path is its old name")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _lora_config(args: argparse.Namespace):  # noqa: ANN202
    from prelude.config import LoraConfig

    slots = args.max_loras if args.max_loras is not None else (4 if args.lora_modules else 0)
    return LoraConfig(slots, args.max_lora_rank) if slots > 0 else None


def _engine_config(args: argparse.Namespace):  # noqa: ANN202
    from prelude.config import CacheConfig, EngineConfig, ExecutorConfig, PolicyConfig, SchedulerConfig

    return EngineConfig(
        lora=_lora_config(args),
        model=args.model,
        hf_overrides=args.hf_overrides,
        served_model_name=args.served_model_name,
        seed=args.seed,
        executor=ExecutorConfig(
            device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager, fused_kernels=args.fused_kernels, compile=args.compile,
            prune_last_layer=args.prune_last_layer, batch_invariant=args.batch_invariant,
            pack_at_start=True,  # a serving engine: its first prompt pays no weight reorders
        ),
        overlap=args.overlap,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_gib=args.kv_cache_memory_gib,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            max_cached_blocks=args.prefix_cache_max_blocks,
            max_recurrent_slots=args.max_recurrent_slots,
            state_checkpoint_stride=args.state_checkpoint_stride, max_state_checkpoints=args.max_state_checkpoints,
            # No page faults on the hot path (model/kv_memory.py): a server fills the pool beside
            # the rest of its start-up; a batch job before its first line, so the RSS its lines
            # add is measured from a full pool
            populate_kv="start" if getattr(args, "command", None) == "run-batch" else "background",
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            policy=args.policy,
            force_paged=args.force_paged_path,
            fuse_oneshot=args.fuse_oneshot,
            prefix_deferral=args.prefix_deferral,
            prefix_riders=args.prefix_riders,
            oneshot_gather_ms=args.oneshot_gather_ms,
            max_decode_batch=args.max_decode_batch,
            default_ttft_slo_ms=args.ttft_slo_ms,
            low_priority_step_tokens=args.low_priority_step_tokens or None,
            policy_options=PolicyConfig(
                srpt_starvation_s=args.srpt_starvation_s,
                mlfq_quanta=tuple(int(q) for q in args.mlfq_quanta.split(",")),
                mlfq_starvation_steps=args.mlfq_starvation_steps,
                laps_boundary=None if args.laps_boundary == "auto" else int(args.laps_boundary),
                laps_long_chunk=args.laps_long_chunk,
                laps_deadline_free=args.laps_deadline_free,
            ),
        ),
    )


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Scale-out on Ray (prelude.cluster): every flag of it, in one place."""
    g = p.add_argument_group("scale-out on Ray")
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="run this many engine replicas as Ray actors behind this server (default: one in-process engine)")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray instance)")
    g.add_argument("--replica-threads", type=int, default=None, help="torch threads (and Ray CPUs) per replica")
    g.add_argument("--router", default="round_robin", choices=["round_robin", "least_load", "prefix"])
    g.add_argument("--router-balance-abs-threshold", type=int, default=4,
                   help="prefix router: load is out of balance when the busiest replica has this many more requests ...")
    g.add_argument("--router-balance-rel-threshold", type=float, default=1.5,
                   help="... and this many times as many as the idlest; then the idlest gets the request")
    g.add_argument("--router-cache-threshold", type=float, default=0.3,
                   help="prefix router: follow a match only if it covers this fraction of the prompt")
    g.add_argument("--laps-pools", default=None, metavar="S:L",
                   help="LAPS spatial mode: S replicas for prompts shorter than --laps-boundary, L for longer ones; "
                        "a pressure controller moves replicas between the pools (each move is logged)")
    g.add_argument("--disaggregate", default=None, metavar="P:D",
                   help="prefill/decode disaggregation (Prophet): P replicas compute prompts and hand the KV blocks "
                        "to D decode replicas through Ray's object store")
    g.add_argument("--max-requests-in-scheduler", type=int, default=None,
                   help="disaggregated: requests one decode replica holds at most; further hand-offs wait "
                        "(backpressure; default: --max-num-seqs)")
    g.add_argument("--prefill-policy", default="srpt", help="disaggregated: the prefill replicas' --policy")
    g.add_argument("--decode-policy", default="mlfq", help="disaggregated: the decode replicas' --policy")


def _pair(text: str, flag: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        return int(a), int(b)
    except ValueError:
        raise SystemExit(f"{flag} takes two counts like 1:1, not {text!r}") from None


def _cluster_config(args: argparse.Namespace):  # noqa: ANN202
    from prelude.cluster.launch import ClusterConfig
    from prelude.cluster.pools import PoolConfig
    from prelude.cluster.router import RouterConfig

    pools = disaggregate = None
    if args.disaggregate:
        disaggregate = _pair(args.disaggregate, "--disaggregate")
        if args.data_parallel_size is None:
            args.data_parallel_size = sum(disaggregate)
    if args.laps_pools:
        pools = _pair(args.laps_pools, "--laps-pools")
        if args.data_parallel_size is None:
            args.data_parallel_size = sum(pools)
    boundary = 256 if args.laps_boundary == "auto" else int(args.laps_boundary)
    return ClusterConfig(
        laps_pools=pools,
        disaggregate=disaggregate,
        max_requests_in_scheduler=args.max_requests_in_scheduler or args.max_num_seqs,
        pool=PoolConfig(boundary=boundary, min_pressure=boundary),
        num_replicas=args.data_parallel_size or 1,
        replica_threads=args.replica_threads,
        ray_address=args.ray_address,
        router=RouterConfig(
            policy=args.router, balance_abs_threshold=args.router_balance_abs_threshold,
            balance_rel_threshold=args.router_balance_rel_threshold, cache_threshold=args.router_cache_threshold,
            block_size=args.block_size,
        ),
    )


def _front(args: argparse.Namespace, while_building: Callable[[], object] | None = None):  # noqa: ANN202
    """The EngineClient behind the app: one in-process engine, or replicas on Ray.
    `while_building`: work for this thread while an in-process engine builds on its own."""
    from dataclasses import replace

    from prelude.engine.async_engine import AsyncEngine
    from prelude.engine.engine import LLMEngine

    config = _engine_config(args)
    if args.data_parallel_size is not None or args.ray_address is not None or args.laps_pools or args.disaggregate:
        from prelude.cluster.launch import engine_factory, start_client, tokenizer_factory

        cluster = _cluster_config(args)
        if cluster.disaggregate is None:
            return start_client(engine_factory(config), cluster, seed=args.seed,
                                tokenizer_factory=tokenizer_factory(config))
        prefill, decode = (replace(config, scheduler=replace(config.scheduler, policy=p))
                           for p in (args.prefill_policy, args.decode_policy))
        return start_client(engine_factory(prefill), cluster, seed=args.seed, tokenizer_factory=tokenizer_factory(config),
                            decode_factory=engine_factory(decode))
    # The engine is built on its own thread, the one that will run every forward.
    return AsyncEngine(lambda: LLMEngine.from_config(config), while_building)


def _serve_multiproc(args: argparse.Namespace) -> int:
    """--api-server-count N: N HTTP processes over one engine process."""
    from dataclasses import replace

    from prelude.entrypoints.multiproc.supervisor import RayEngines, Supervisor

    if args.api_server_count < 1:
        raise SystemExit("--api-server-count must be at least 1")
    config = _engine_config(args)
    ray_engines = None
    if args.data_parallel_size is not None or args.ray_address is not None or args.laps_pools or args.disaggregate:
        from prelude.cluster.launch import engine_factory

        cluster = _cluster_config(args)
        if cluster.disaggregate is not None:
            prefill_cfg, decode_cfg = (replace(config, scheduler=replace(config.scheduler, policy=p))
                                       for p in (args.prefill_policy, args.decode_policy))
            ray_engines = RayEngines(cluster, engine_factory(prefill_cfg), engine_factory(decode_cfg))
        else:
            ray_engines = RayEngines(cluster, engine_factory(config))
    if args.lora_modules:
        raise SystemExit("--api-server-count does not serve LoRA adapters yet (its HTTP processes hold no adapter names)")
    if args.trace_stages:
        raise SystemExit("--api-server-count does not trace stages yet (the engine's timestamps stay in its process)")
    limits = _server_limits(args)
    if limits.max_waiting_requests is not None:  # the bound is the server's: each HTTP process gets its share
        share = -(-limits.max_waiting_requests // args.api_server_count)
        limits = dataclasses.replace(limits, max_waiting_requests=share)
    settings = {"seed": args.seed, "api_key": args.api_key or os.environ.get("PRELUDE_API_KEY") or None,
                "limits": limits, "metrics_require_key": args.metrics_require_key,
                "log_level": args.log_level, "log_format": args.log_format}
    return Supervisor(config, args.api_server_count, args.host, args.port, settings, ray_engines).run()


def _import_server() -> None:
    """The HTTP server's modules (FastAPI, pydantic, the routes: ~0.4-0.8 s), imported while
    the engine builds (`_front`'s while_building); then every module's objects frozen, so
    the collection at ready walks only what loading built."""
    import warnings

    import prelude.entrypoints.openai.api_server  # noqa: F401
    from prelude.heap import freeze_imports

    # FastAPI imports pydantic.v1 when it analyzes the first route's parameters (its check
    # for v1 models): work that would follow the engine's build, now beside it.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            import pydantic.v1  # noqa: F401
    except ImportError:  # a pydantic without v1: FastAPI then skips it too
        pass

    freeze_imports()


def _serve(args: argparse.Namespace) -> int:
    from prelude.startup import StartupError

    if args.api_server_count is not None:
        return _serve_multiproc(args)
    log = logging.getLogger("prelude.cli")
    try:
        front = _front(args, _import_server)
    except StartupError:
        raise
    except Exception as exc:  # what only loading can tell: still one line, the stack to the debug log
        log.debug("loading failed", exc_info=True)
        raise StartupError(f"loading {args.model or 'the default model'} failed: {type(exc).__name__}: {exc}; "
                           "check --model (the stack: --log-level debug)") from exc
    from prelude.entrypoints.batch.store import default_batch_dir
    from prelude.entrypoints.batch.worker import BatchRunnerConfig
    from prelude.entrypoints.openai.api_server import build_app, run_server
    from prelude.entrypoints.openai.errors import APIError

    try:
        app = build_app(front, api_key=args.api_key or os.environ.get("PRELUDE_API_KEY") or None,
                        limits=_server_limits(args), metrics_require_key=args.metrics_require_key,
                        trace_stages=args.trace_stages, lora_modules=args.lora_modules,
                        batch_dir=args.batch_dir or default_batch_dir(),
                        batch_runner=BatchRunnerConfig(max_inflight=args.batch_max_inflight))
    except APIError as e:  # a bad --lora-modules adapter
        front.shutdown()
        raise StartupError(e.message) from None
    log.info("ready: serving %s on http://%s:%d in %.2f s from start",
             front.model_name, args.host, args.port, time.perf_counter() - _STARTED)
    try:
        return run_server(app, args.host, args.port, engine=front)
    finally:
        front.shutdown()


def _add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch job")
    g.add_argument("-i", "--input-file", required=True, help="OpenAI Batch JSONL: {custom_id, method, url, body} per line")
    g.add_argument("-o", "--output-file", required=True, help="JSONL with one answer line per input line")
    g.add_argument("--resume", action="store_true",
                   help="keep OUTPUT's lines and run only the custom_ids it lacks (after a crash or kill)")
    g.add_argument("--max-inflight", type=int, default=None,
                   help="lines in the engine at once (default: 2 x --max-num-seqs)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _run_batch(args: argparse.Namespace) -> int:
    from prelude.entrypoints.batch.cli import run_batch
    from prelude.heap import freeze_imports

    freeze_imports()  # the modules: the collection once loaded walks only what loading built
    front = _front(args)
    try:
        return run_batch(args, front, _server_limits(args))
    finally:
        front.shutdown()


def _add_batch_api_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch API (/v1/files, /v1/batches)")
    g.add_argument("--batch-dir", default=None,
                   help="where /v1/files and /v1/batches keep files and batch states (default: "
                        "~/.cache/prelude/batches); a restarted server resumes its unfinished batches")
    g.add_argument("--batch-max-inflight", type=int, default=32,
                   help="/v1/batches: batch lines in the engine at once (low-priority requests: the scheduler "
                        "runs them behind interactive ones); keep it under --max-num-seqs")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """HTTP-side flags: auth, limits, drain, logs (grouped; engine flags are above)."""
    g = p.add_argument_group("server: auth, limits, drain, logs")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-server-count", type=int, default=None,
                   help="N HTTP processes (parse, tokenize, detokenize, serialize) over one engine process; "
                        "default: one process, engine and HTTP together (faster at low load, see docs/multiproc.md)")
    g.add_argument("--api-key", default=None,
                   help="bearer token every route but /health (and /metrics) needs (or PRELUDE_API_KEY)")
    g.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests waiting to start past which new ones get 429 (default: unbounded)")
    g.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20, help="413 above (default 32 MiB)")
    g.add_argument("--max-request-tokens", type=int, default=262_144,
                   help="prompt tokens x n of one request, 400 above")
    g.add_argument("--max-batch-inputs", type=int, default=2048,
                   help="prompts / inputs / documents of one request, 400 above")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request is aborted (408 or an error event; default: none)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before an error ends them")
    g.add_argument("--trace-stages", action="store_true",
                   help="time every request's host stages (parse, tokenize, validate, hops, schedule, forward, "
                        "sample, detokenize, serialize); read them at GET /debug/stages (prelude bench overhead)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one JSON object per line, with one line per finished request")


def _server_limits(args: argparse.Namespace):  # noqa: ANN202
    from prelude.entrypoints.openai.limits import ServerLimits

    return ServerLimits(
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_request_body_bytes,
        max_request_tokens=args.max_request_tokens,
        max_batch_inputs=args.max_batch_inputs,
        request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prelude", description="Prelude LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    _add_engine_args(serve)
    _add_server_args(serve)
    _add_batch_api_args(serve)
    _add_cluster_args(serve)
    run_batch = sub.add_parser("run-batch", help="run an OpenAI Batch file offline (no HTTP in between)")
    _add_batch_args(run_batch)
    _add_engine_args(run_batch)
    _add_server_args(run_batch)
    _add_cluster_args(run_batch)
    # a job's shared prefixes stay on one replica; a resumed job repeats a clean run's answers
    run_batch.set_defaults(router="prefix", batch_invariant=True)
    sub.add_parser("tokenizer-bench", help="fasttoken vs HF tokenizers", add_help=False)
    # add_help=False: `prelude bench profile --help` reaches the benchmark's own parser.
    bench = sub.add_parser("bench", add_help=False,
                           help="benchmarks: serve | batch | overhead | profile | oneshot | prefix | sched | "
                                "decisions | soak | cluster | simulate")
    # kernel micro-benchmarks are lab instruments outside the package: `python -m benchmarks.<name>`
    bench.add_argument("which", nargs="?", choices=["serve", "batch", "overhead", "profile", "oneshot", "prefix", "sched",
                                                    "decisions", "soak", "cluster", "simulate"])
    args, rest = parser.parse_known_args(argv)
    if args.command == "tokenizer-bench":
        from prelude.bench.tokenizer_bench import main as tokenizer_bench

        return tokenizer_bench(rest)
    if args.command == "bench":
        if args.which is None:  # `prelude bench`, `prelude bench --help`
            bench.print_help()
            return 0 if rest in (["-h"], ["--help"]) else 2
        if args.which == "prefix":
            from prelude.bench.prefix_bench import main as bench_main
        elif args.which == "serve":
            from prelude.bench.serve_bench import main as bench_main
        elif args.which == "soak":
            from prelude.bench.soak import main as bench_main
        elif args.which == "cluster":
            from prelude.bench.cluster_bench import main as bench_main
        elif args.which == "simulate":
            from prelude.bench.simulate_bench import main as bench_main
        elif args.which == "sched":
            from prelude.bench.sched_bench import main as bench_main
        elif args.which == "batch":
            from prelude.bench.batch_bench import main as bench_main
        elif args.which == "decisions":
            from prelude.bench.decisions_bench import main as bench_main
        elif args.which == "profile":
            from prelude.bench.profile_bench import main as bench_main
        elif args.which == "overhead":
            from prelude.bench.overhead_bench import main as bench_main
        else:
            from prelude.bench.oneshot_bench import main as bench_main
        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from prelude.heap import collection_paused_for_startup
    from prelude.log_format import configure_logging
    from prelude.entrypoints.batch.cli import check_job_paths
    from prelude.startup import StartupError, check_engine_args, check_serve_args

    configure_logging(args.log_level, args.log_format)
    # Until the model and the routes are loaded (freeze_startup_heap resumes it); not in
    # --api-server-count's supervisor, which loads nothing and never freezes.
    paused = collection_paused_for_startup() if args.api_server_count is None else contextlib.nullcontext()
    with paused:
        if args.command == "run-batch":
            try:
                check_job_paths(args.input_file, args.output_file)
                check_engine_args(args)
            except StartupError as exc:
                print(f"prelude run-batch: error: {exc}", file=sys.stderr)
                return 2
            return _run_batch(args)
        try:
            check_serve_args(args)
            return _serve(args)
        except StartupError as exc:
            # One line, no stack: the message names the problem and its fix.
            print(f"prelude serve: error: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
