"""Start-up to ready of `prelude serve` on CUDA, with its log kept (the benchmark's servers log
to a temporary file): `python3 scripts/gpu/startup.py NAME [--src SRC] [--shape S] [serve flags...]`.
SRC: another checkout's src folder (old vs new). The log goes to $OUT/start_NAME.log; the
lines that time the start are printed."""
import argparse
import os
import subprocess
import sys
import time
import urllib.request

from prelude.testing.random_model import random_model_dir

ap = argparse.ArgumentParser()
ap.add_argument("name")
ap.add_argument("--src", default=None)
ap.add_argument("--shape", default="qwen3-0.6b")
ap.add_argument("--port", type=int, default=8130)
args, serve_flags = ap.parse_known_args()
env = dict(os.environ)
if args.src:
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(args.src), env.get("PYTHONPATH", "")) if p)
log_path = os.path.join(os.environ.get("OUT", "."), f"start_{args.name}.log")
cmd = [sys.executable, "-m", "prelude.cli", "serve", "--model", str(random_model_dir(args.shape)),
       "--port", str(args.port), "--device", "cuda", *serve_flags]
with open(log_path, "wb") as log:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    ready = None
    while proc.poll() is None and time.perf_counter() - t0 < 300:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1) as r:
                if r.status == 200:
                    ready = time.perf_counter() - t0
                    break
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    proc.wait(60)
print(f"{args.name}: ready in {ready:.2f} s" if ready is not None else f"{args.name}: never ready (rc {proc.returncode})")
with open(log_path, encoding="utf-8", errors="replace") as f:
    for line in f:
        if any(w in line for w in ("loaded", "ready", "graph", "KV cache", "captur", "compil")):
            print("  " + line.rstrip()[:300])
