#!/usr/bin/env bash
# Every benchmark mode on one NVIDIA GPU at a real Qwen3 shape (random weights), sized to
# finish within about 10 minutes on an H100/H200; prints a short table at the end.
#
#   bash launch/bench_gpu.sh                     # Qwen3-0.6B shape
#   MODEL=qwen3_4b bash launch/bench_gpu.sh      # Qwen3-4B shape
#
# Install first: bash launch/install_gpu.sh cuda
#
# XLA flags used, and why:
#   --xla_gpu_enable_latency_hiding_scheduler  overlap collectives/copies with compute
#   XLA_PYTHON_CLIENT_MEM_FRACTION=0.9         let the KV cache use most of HBM up front
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-qwen3_0_6b}
OUT=${OUT:-bench_out/gpu_${MODEL}}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
CONFIG="configs/gpu_bench.py:${MODEL}"

run() {  # mode name, then flags; keeps the JSON line
  local name=$1; shift
  echo "== $name"
  python -m april_jax.bench --out_dir="$OUT" "$@" | tee "$OUT/$name.log"
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
}

run sampler --mode=sampler --models="$MODEL" --hf=false --dtype=bfloat16 --batch=64 \
    --prompt_len=256 --new_tokens=512 --repeats=2
run scheduler --mode=scheduler --config="$CONFIG" --dist=deepmath --steps=4 \
    --max_response_len=2048
run resume --mode=resume --config="$CONFIG" --dist=deepmath --steps=3 --max_response_len=1024

python - "$OUT" "$MODEL" <<'PY'
import json, sys
out, model = sys.argv[1], sys.argv[2]
load = lambda name: json.load(open(f"{out}/{name}.json"))
s, sch, res = load("sampler"), load("scheduler"), load("resume")
print(f"\n{model} on {s['machine']['device_kind']}")
print(f"  decode tokens/s            {s[model + '_april_jax_tokens_per_s']:>12,.0f}")
if model + "_bandwidth_bound_tokens_per_s" in s:
  print(f"  bandwidth bound tokens/s   {s[model + '_bandwidth_bound_tokens_per_s']:>12,.0f}"
        f"  ({s[model + '_bandwidth_utilisation']:.0%} of it)")
print(f"  APRIL vs baseline          {sch['speedup']:>11.2f}x  (occupancy "
      f"{sch['april_slot_occupancy']:.2f} vs {sch['baseline_slot_occupancy']:.2f})")
print(f"  resume kv vs recompute     {res['kv_us_per_held_token']:.2f} vs "
      f"{res['recompute_us_per_held_token']:.2f} us per held token")
PY
