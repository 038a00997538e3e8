#!/usr/bin/env bash
# SGLang's own client against a launched server, without and with --enable-granikv:
#   python -m sglang.launch_server ... [--enable-granikv]
#   python -m sglang.bench_serving --backend sglang --dataset-name generated-shared-prefix
#       --gsp-num-groups 1 --gsp-prompts-per-group $AGENTS --gsp-system-prompt-len $PREFIX ...
#
# Usage (from the repo root):
#   bash benchmark/multi_agent/bench_serving.sh                       # any GPU machine
# Settings (environment): BACKEND=flashinfer|triton  PREFIX=16384  AGENTS=64  SUFFIX=256
#   OUT_LEN=256  GSP_GROUPS=1  MODEL=llama-3.1-8b  TP=1  PORT=30000  CONFIGS="baseline granikv"
#   OUT=docs/results/bench_serving (or $OUT if set)  EXTRA_SERVER_ARGS=""  PY=python3
# Writes, per config: $OUT/bench_serving_<backend>_<config>.jsonl (bench_serving's result line),
# .log (its console output), server_<backend>_<config>.log; then bench_serving_<backend>.json /
# .md with output tok/s, TTFT and TPOT (median, p99) side by side and the ratio.
#
# The model is dummy weights from the shipped config plus a generated word-level tokenizer
# (python -m benchmark.multi_agent.run --write-model-dir), because bench_serving sends text. The client needs aiohttp; the
# modules it imports but never uses on this dataset (HF datasets, PIL) are stubbed if missing.
set -euo pipefail

PY=${PY:-python3}
BACKEND=${BACKEND:-flashinfer}
PREFIX=${PREFIX:-16384}
AGENTS=${AGENTS:-64}
SUFFIX=${SUFFIX:-256}
OUT_LEN=${OUT_LEN:-256}
GSP_GROUPS=${GSP_GROUPS:-1}
MODEL=${MODEL:-llama-3.1-8b}
TP=${TP:-1}
PORT=${PORT:-30000}
CONFIGS=${CONFIGS:-baseline granikv}
OUT=${OUT:-docs/results}/bench_serving
EXTRA_SERVER_ARGS=${EXTRA_SERVER_ARGS:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)  # the benchmark package runs from the repository root

mkdir -p "$OUT"
work=$(mktemp -d /tmp/granikv_bench_serving.XXXXXX)
model_dir="$work/model"
(cd "$ROOT" && "$PY" -m benchmark.multi_agent.run --model "$MODEL" --write-model-dir "$model_dir" >/dev/null)

# Stub client-side imports that the generated-shared-prefix path never calls.
stubs="$work/stubs"
mkdir -p "$stubs"
if ! "$PY" -c "import datasets" 2>/dev/null; then
  mkdir -p "$stubs/datasets" && echo "def load_dataset(*a, **k): raise RuntimeError('stub')" >"$stubs/datasets/__init__.py"
fi
if ! "$PY" -c "import PIL.Image" 2>/dev/null; then
  mkdir -p "$stubs/PIL" && echo "" >"$stubs/PIL/__init__.py" && echo "class Image: pass" >"$stubs/PIL/Image.py"
fi
"$PY" -c "import aiohttp" 2>/dev/null || { echo "sglang.bench_serving needs aiohttp (pip install aiohttp)"; exit 1; }
client_path="${PYTHONPATH:+$PYTHONPATH:}$stubs"

server_pid=""
stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill "$server_pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
    kill -9 "$server_pid" 2>/dev/null || true
  fi
  server_pid=""
}
trap 'stop_server; rm -rf "$work"' EXIT

wait_ready() {
  "$PY" - "$PORT" "$server_pid" <<'EOF'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.time() + 900
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server exited before it was ready")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=30) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception:
        pass
    time.sleep(2)
sys.exit("server not ready after 900 s")
EOF
}

for cfg in $CONFIGS; do
  flag=""
  [ "$cfg" = granikv ] && flag="--enable-granikv"
  name="${BACKEND}_${cfg}"
  echo "== $name: launching server"
  # shellcheck disable=SC2086
  "$PY" -m sglang.launch_server --model-path "$model_dir" --load-format dummy \
    --attention-backend "$BACKEND" --sampling-backend pytorch --grammar-backend none \
    --mem-fraction-static 0.85 --max-running-requests 256 --disable-prefill-cuda-graph \
    --cuda-graph-max-bs-decode 256 --tp-size "$TP" --host 127.0.0.1 --port "$PORT" \
    --log-level warning --enable-metrics $flag $EXTRA_SERVER_ARGS >"$OUT/server_$name.log" 2>&1 &
  server_pid=$!
  wait_ready
  echo "== $name: bench_serving"
  rm -f "$OUT/bench_serving_$name.jsonl"
  PYTHONPATH="$client_path" "$PY" -m sglang.bench_serving --backend sglang \
    --host 127.0.0.1 --port "$PORT" --model "$model_dir" --tokenizer "$model_dir" \
    --dataset-name generated-shared-prefix --gsp-num-groups "$GSP_GROUPS" \
    --gsp-prompts-per-group "$AGENTS" --gsp-system-prompt-len "$PREFIX" \
    --gsp-question-len "$SUFFIX" --gsp-output-len "$OUT_LEN" --gsp-range-ratio 1 \
    --num-prompts $((GSP_GROUPS * AGENTS)) --request-rate inf --seed 1 \
    --output-file "$OUT/bench_serving_$name.jsonl" 2>&1 | tee "$OUT/bench_serving_$name.log"
  # What the server did (GraniKV: decode steps per attention path, promotions, HOT hits; both:
  # SGLang's counters), so that a figure can be explained after the run.
  "$PY" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())" \
    "http://127.0.0.1:$PORT/metrics" | grep -E '^(granikv|sglang):' >"$OUT/metrics_$name.txt" || true
  stop_server
done

"$PY" - "$OUT" "$BACKEND" "$PREFIX" "$AGENTS" "$GSP_GROUPS" <<'EOF'
import json, os, subprocess, sys
from datetime import datetime, timezone
out, backend, prefix, agents, groups = sys.argv[1:6]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout.strip().splitlines()[0]
except Exception:
    gpu = None
date = datetime.now(timezone.utc).isoformat(timespec="seconds")
command = (f"BACKEND={backend} PREFIX={prefix} AGENTS={agents} GSP_GROUPS={groups} "
           "bash benchmark/multi_agent/bench_serving.sh")
keys = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "completed", "total_output_tokens", "duration"]
res = {}
for cfg in ("baseline", "granikv"):
    p = os.path.join(out, f"bench_serving_{backend}_{cfg}.jsonl")
    if os.path.exists(p) and os.path.getsize(p):
        last = json.loads(open(p).read().strip().splitlines()[-1])
        res[cfg] = {k: last.get(k) for k in keys}
b, g = res.get("baseline", {}), res.get("granikv", {})
ratio = (g["output_throughput"] / b["output_throughput"]
         if b.get("output_throughput") and g.get("output_throughput") else None)
summary = dict(backend=backend, prefix_len=int(prefix), agents=int(agents), groups=int(groups),
               baseline=b or None, granikv=g or None, speedup=ratio, gpu=gpu, date=date, command=command)
json.dump(summary, open(os.path.join(out, f"bench_serving_{backend}.json"), "w"), indent=1)
f = lambda x, s="{:,.1f}": "–" if x is None else s.format(x)
md = [f"# sglang.bench_serving, generated-shared-prefix: {groups} x {prefix}-token system prompt, "
      f"{agents} prompts per group, backend {backend}", "",
      f"GPU: {gpu or 'unknown'}; date: {date}. Both servers launched in the same run, one after the other.", "",
      f"Command: `{command}`", "",
      "| config | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
      "|---|---:|---:|---:|---:|---:|"]
for cfg, r in (("baseline", b), ("granikv", g)):
    md.append(f"| {cfg} | " + " | ".join(f(r.get(k)) for k in keys[:5]) + " |")
md += ["", f"Speedup (output tok/s): {f(ratio, '{:.2f}x')}"]
mp = os.path.join(out, f"metrics_{backend}_granikv.txt")
gk = [ln for ln in open(mp).read().splitlines() if ln.startswith("granikv:")] if os.path.exists(mp) else []
if gk:  # GraniKV's own counters at the end of the run (decode steps per path, promotions, HOT hits)
    md += ["", "GraniKV counters at the end of the run (`/metrics`, `granikv:*`):", "", "```"] + gk + ["```"]
open(os.path.join(out, f"bench_serving_{backend}.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
EOF
