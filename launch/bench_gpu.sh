#!/usr/bin/env bash
# Every benchmark mode on one NVIDIA GPU at real Qwen3 shapes (random weights), sized to
# finish within about 8 minutes on an H100/H200; prints a short table at the end: whether
# this backend copies the pages that decode attention gathers (one chunk compiled at the 8B
# config's shapes), decode tokens/s against the memory-bandwidth bound for the Qwen3-0.6B
# and 4B shapes (and against a plain static-batch JAX sampler; bytes per step over step time
# as a fraction of the copy bandwidth measured in the same run), then APRIL vs the baseline
# and kv vs recompute resume at the MODEL shape.
#
#   bash launch/bench_gpu.sh                     # scheduler and resume at Qwen3-0.6B
#   MODEL=qwen3_4b bash launch/bench_gpu.sh      # ... at Qwen3-4B
#   PARTS="roofline sampler" bash launch/bench_gpu.sh   # some parts only, in this order
#   SAMPLER_MODELS=tiny TAIL_MODEL=tiny CONFIG=configs/tiny.py MAX_RESPONSE_LEN=64 \
#       bash launch/bench_gpu.sh                 # a smoke run on a CPU (about 6 minutes)
#
# Each part's log (its last line is the JSON result) goes to OUT; the Markdown reports and
# plots go to REPORTS (default OUT), so OUT can be kept to a handful of files.
#
# Install first: bash launch/install_gpu.sh cuda (or, offline, the machine's own jax with
# PYTHONPATH pointing at this checkout).
#
# XLA flags used, and why:
#   --xla_gpu_enable_latency_hiding_scheduler  overlap collectives/copies with compute
#   XLA_PYTHON_CLIENT_MEM_FRACTION=0.9         let the KV cache use most of HBM up front
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-qwen3_0_6b}
OUT=${OUT:-bench_out/gpu_${MODEL}}
REPORTS=${REPORTS:-$OUT}
PARTS=${PARTS:-roofline sampler scheduler resume}
mkdir -p "$OUT" "$REPORTS"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
CONFIG=${CONFIG:-configs/gpu_bench.py:${MODEL}}
SAMPLER_MODELS=${SAMPLER_MODELS:-qwen3_0_6b,qwen3_4b}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-2048}

run() {  # mode name, then flags; the log's last line is the JSON result
  local name=$1; shift
  echo "== $name ($(date -u +%H:%M:%S))"
  python -m april_jax.bench --out_dir="$REPORTS" "$@" | tee "$OUT/$name.log"
}

for part in $PARTS; do
  case $part in
    # Compiles one chunk of paged decode attention at the 8B config's per-device shapes on
    # this backend: whether the gathered pages are copied into scratch (seconds, no weights).
    roofline) run roofline --mode=roofline --config="${ROOFLINE_CONFIG:-configs/qwen3_8b.py}" \
        --dist=dapo_math ;;
    sampler) run sampler --mode=sampler --models="$SAMPLER_MODELS" --hf=false --dtype=bfloat16 \
        --batch=64 --prompt_len=256 --new_tokens=512 --repeats=2 \
        --tail_model="${TAIL_MODEL:-qwen3_0_6b}" ;;
    scheduler) run scheduler --mode=scheduler --config="$CONFIG" --dist=deepmath --steps=4 \
        --max_response_len="$MAX_RESPONSE_LEN" ;;
    resume) run resume --mode=resume --config="$CONFIG" --dist=deepmath --steps=3 \
        --max_response_len=$((MAX_RESPONSE_LEN / 2)) ;;
    *) echo "bench_gpu.sh: unknown part '$part' in PARTS (roofline sampler scheduler resume)" >&2
       exit 2 ;;
  esac
done

python - "$OUT" "$CONFIG" "$SAMPLER_MODELS" "$PARTS" <<'PY'
import json, sys
out, model, sampler_models, parts = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
load = lambda name: json.loads(open(f"{out}/{name}.log").read().strip().splitlines()[-1])
r = {name: load(name) for name in parts.split()}
kinds = [v["machine"]["device_kind"] for v in r.values() if "machine" in v]
print(f"\non {kinds[0] if kinds else r.get('roofline', {}).get('backend', '?')}")
if "roofline" in r:
  roof = r["roofline"]
  copied = roof["chunk_scratch_over_kv"] > 0.5
  print(f"decode attention at the roofline config's shapes, compiled on {roof['backend']}: a "
        f"chunk's scratch {roof['chunk_scratch_bytes'] / 1e6:.1f} MB for "
        f"{roof['chunk_kv_bytes'] / 1e6:.1f} MB of KV ({roof['chunk_scratch_over_kv']:.2f}x): "
        + (f"the gathered pages are copied; a step moves up to "
           f"{roof['paged_copied_over_bound']:.2f}x the live bound" if copied else
           f"the gather is fused; a step reads about {roof['paged_over_bound']:.2f}x the live bound"))
if "sampler" in r:
  s = r["sampler"]
  for m in sampler_models:
    print(f"{m}: decode tokens/s {s[m + '_april_jax_tokens_per_s']:>10,.0f}"
          f"  (static-batch sampler {s[m + '_static_tokens_per_s']:,.0f}); decode step "
          f"{s[m + '_decode_step_ms']:.2f} ms vs {s[m + '_static_decode_step_ms']:.2f} ms static")
    if m + "_copy_bandwidth_frac" in s:
      print(f"  bytes per decode step {s[m + '_step_bytes'] / 1e9:.3f} GB: "
            f"{s[m + '_copy_bandwidth_frac']:.0%} of the copy bandwidth measured in this run "
            f"({s[m + '_copy_gbps']:,.0f} GB/s)")
    if m + "_bandwidth_bound_tokens_per_s" in s:
      print(f"  bandwidth bound tokens/s   {s[m + '_bandwidth_bound_tokens_per_s']:>12,.0f}"
            f"  ({s[m + '_bandwidth_utilisation']:.0%} of it)")
  tm = next((k[: -len("_tail_over_uniform")] for k in s if k.endswith("_tail_over_uniform")), None)
  if tm:
    print(f"{tm}: decode step, long-tailed mix {s[tm + '_tail_step_ms']:.2f} ms vs uniform "
          f"{s[tm + '_uniform_step_ms']:.2f} ms (medians); ratio, median of the rounds "
          f"{s[tm + '_tail_over_uniform']:.2f}x ({s[tm + '_tail_over_uniform_min']:.2f}-"
          f"{s[tm + '_tail_over_uniform_max']:.2f}x)")
if "scheduler" in r or "resume" in r:
  print(model)
if "scheduler" in r:
  sch = r["scheduler"]
  print(f"  APRIL vs baseline          {sch['speedup']:>11.2f}x  (occupancy "
        f"{sch['april_slot_occupancy']:.2f} vs {sch['baseline_slot_occupancy']:.2f})")
if "resume" in r:
  res = r["resume"]
  print(f"  resume kv vs recompute     {res['kv_us_per_held_token']:.2f} vs "
        f"{res['recompute_us_per_held_token']:.2f} us per held token")
PY
