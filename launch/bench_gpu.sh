#!/usr/bin/env bash
# Every benchmark mode on one NVIDIA GPU at real Qwen3 shapes (random weights), in parts,
# the quickest and most telling first; prints a short table at the end:
#   roofline    one chunk of paged decode attention compiled and timed at the 8B config's
#               per-device shapes (seconds): does this backend copy the gathered pages,
#               and what does that cost against the same pages read in place; and one
#               layer at the steady state through the XLA path and the Pallas kernel,
#               the engine's and two candidates (its runs merged by a second kernel,
#               and that with fewer, longer runs)
#   sampler     decode tokens/s at the Qwen3-0.6B shape through the XLA path, against a
#               plain static-batch JAX sampler, bytes per step over step time as a
#               fraction of the copy bandwidth measured in the same run, and a
#               long-tailed vs uniform step
#   scheduler   APRIL vs the baseline at the MODEL shape on its config's engine, each side's
#               rollout time split (decoding, starting groups, resuming, the snapshot)
#   resume      kv vs recompute resume at the MODEL shape
#   sampler_kernel  the sampler part with the engine decoding through the Pallas kernel
#   tail, tail_kernel  the sampler part's long-tailed vs uniform step alone, through the
#               XLA path or the Pallas kernel
#   sampler_4b  the sampler part at the Qwen3-4B shape
# Each part stops after PART_LIMIT seconds (default 300; LIMIT_<part> for one part, e.g.
# LIMIT_sampler=60), keeping what its log printed
# (each sampler stage is named on stderr as it starts), and the next part runs. On an
# H200 (2026-12-04) the sampler part at 0.6B and 4B with 512 new tokens did not finish in
# 6.5 minutes, so it now runs 0.6B alone at 256 new tokens.
#
#   bash launch/bench_gpu.sh                     # scheduler and resume at Qwen3-0.6B
#   MODEL=qwen3_4b bash launch/bench_gpu.sh      # ... at Qwen3-4B
#   PARTS="roofline sampler" bash launch/bench_gpu.sh   # some parts only, in this order
#   PARTS="roofline sampler scheduler resume" SAMPLER_MODELS=tiny TAIL_MODEL=tiny \
#       CONFIG=configs/tiny.py MAX_RESPONSE_LEN=64 bash launch/bench_gpu.sh   # CPU smoke run
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
PARTS=${PARTS:-scheduler roofline tail_kernel sampler_kernel tail sampler resume sampler_4b}
mkdir -p "$OUT" "$REPORTS"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
CONFIG=${CONFIG:-configs/gpu_bench.py:${MODEL}}
SAMPLER_MODELS=${SAMPLER_MODELS:-qwen3_0_6b}
NEW_TOKENS=${NEW_TOKENS:-256}
PART_LIMIT=${PART_LIMIT:-300}  # seconds; a part past it is stopped and the next one runs
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-2048}

run() {  # part name, then flags; the log's last line is the JSON result (if it finished)
  local name=$1; shift
  local limit_var="LIMIT_$name"
  local limit=${!limit_var:-$PART_LIMIT}
  echo "== $name ($(date -u +%H:%M:%S))"
  timeout "$limit" python -m april_jax.bench --out_dir="$REPORTS" "$@" \
    | tee "$OUT/$name.log" || echo "== $name stopped (exit ${PIPESTATUS[0]}, limit ${limit}s)"
}

for part in $PARTS; do
  case $part in
    # Compiles one chunk of paged decode attention at the 8B config's per-device shapes on
    # this backend: whether the gathered pages are copied into scratch (seconds, no weights).
    roofline) run roofline --mode=roofline --config="${ROOFLINE_CONFIG:-configs/qwen3_8b.py}" \
        --dist=dapo_math ;;
    sampler) run sampler --mode=sampler --models="$SAMPLER_MODELS" --hf=false --dtype=bfloat16 \
        --batch=64 --prompt_len=256 --new_tokens="$NEW_TOKENS" --repeats=1 \
        --tail_model="${TAIL_MODEL-qwen3_0_6b}" --tail_rounds=3 --decode_attention=xla ;;
    # The sampler part's decode through the Pallas kernel (rollout.decode_attention).
    sampler_kernel) run sampler_kernel --mode=sampler --models=qwen3_0_6b --hf=false \
        --dtype=bfloat16 --batch=64 --prompt_len=256 --new_tokens="$NEW_TOKENS" --repeats=1 \
        --tail_model= --decode_attention=pallas ;;
    # The long-tailed vs uniform step at the 0.6B shape alone, by either decode attention.
    tail) run tail --mode=sampler --models= --tail_model="${TAIL_MODEL-qwen3_0_6b}" \
        --tail_rounds=3 --decode_attention=xla ;;
    tail_kernel) run tail_kernel --mode=sampler --models= --tail_model="${TAIL_MODEL-qwen3_0_6b}" \
        --tail_rounds=3 --decode_attention=pallas ;;
    # The Qwen3-4B shape alone, without the long-tail rounds (run after the others).
    sampler_4b) run sampler_4b --mode=sampler --models=qwen3_4b --hf=false --dtype=bfloat16 \
        --batch=64 --prompt_len=256 --new_tokens="$NEW_TOKENS" --repeats=1 --tail_model= ;;
    scheduler) run scheduler --mode=scheduler --config="$CONFIG" --dist=deepmath --steps=4 \
        --max_response_len="$MAX_RESPONSE_LEN" ;;
    resume) run resume --mode=resume --config="$CONFIG" --dist=deepmath --steps=3 \
        --max_response_len=$((MAX_RESPONSE_LEN / 2)) ;;
    *) echo "bench_gpu.sh: unknown part '$part' in PARTS (roofline sampler sampler_kernel" \
         "tail tail_kernel scheduler resume sampler_4b)" >&2
       exit 2 ;;
  esac
done

python - "$OUT" "$CONFIG" "$SAMPLER_MODELS" "$PARTS" <<'PY'
import json, sys
out, model, sampler_models, parts = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
def load(name):
  try:
    return json.loads(open(f"{out}/{name}.log").read().strip().splitlines()[-1])
  except (OSError, IndexError, ValueError):
    print(f"{name}: did not finish (see its log)")
    return None
r = {name: res for name in parts.split() if (res := load(name)) is not None}
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
  if "kernel_over_bound" in roof:
    print(f"  through the kernel a step reads {roof['kernel_over_bound']:.3f}x the live bound; "
          f"its longest program walks {roof['kernel_longest_walk_blocks']} blocks, the "
          f"longest slot holds {roof['kernel_longest_slot_blocks']}")
  from april_jax.benchmarks.roofline import layer_lines
  for line in layer_lines(roof):
    print(line)
  if "chunk_gathered_us" in roof:
    mb = lambda name: roof[f"chunk_{name}_scratch_bytes"] / 1e6
    print(f"  timed, us a chunk (scratch MB): gathered {roof['chunk_gathered_us']:.1f} "
          f"({mb('gathered'):.1f}), gathered by multiply-and-sum {roof['chunk_reduced_us']:.1f} "
          f"({mb('reduced'):.1f}), the same pages side by side "
          f"{roof['chunk_side_by_side_us']:.1f} ({mb('side_by_side'):.1f}): "
          f"{roof['chunk_gather_time_ratio']:.2f}x and {roof['chunk_reduced_time_ratio']:.2f}x "
          f"the side-by-side time; gathered, {roof['chunk_gathered_copy_frac']:.0%} of the copy "
          f"bandwidth")
for part, models in (
    ("sampler", sampler_models), ("sampler_kernel", ["qwen3_0_6b"]), ("sampler_4b", ["qwen3_4b"]),
    ("tail", []), ("tail_kernel", [])):
  if part not in r:
    continue
  s = r[part]
  for m in models:
    print(f"{m}, decode attention {s.get('decode_attention', 'xla')}: decode tokens/s {s[m + '_april_jax_tokens_per_s']:>10,.0f}"
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
    print(f"{tm}, decode attention {s.get('decode_attention', 'xla')}: decode step, long-tailed "
          f"mix {s[tm + '_tail_step_ms']:.2f} ms vs uniform "
          f"{s[tm + '_uniform_step_ms']:.2f} ms (medians); ratio, median of the rounds "
          f"{s[tm + '_tail_over_uniform']:.2f}x ({s[tm + '_tail_over_uniform_min']:.2f}-"
          f"{s[tm + '_tail_over_uniform_max']:.2f}x)")
if "scheduler" in r or "resume" in r:
  print(model)
if "scheduler" in r:
  sch = r["scheduler"]
  print(f"  APRIL vs baseline          {sch['speedup']:>11.2f}x  (occupancy "
        f"{sch['april_slot_occupancy']:.2f} vs {sch['baseline_slot_occupancy']:.2f})")
  if "april_snapshot_frac" in sch:
    print(f"  of the host-free ideal {sch['of_host_free_ideal']:.0%}; APRIL's rollout: decoding "
          f"{sch['april_decode_frac']:.0%}, snapshot {sch['april_snapshot_frac']:.0%}, resuming "
          f"{sch['april_resume_frac']:.0%}; KV to and from the host "
          f"{sch.get('april_kv_host_mb_per_step', float('nan')):,.0f} MB a step")
if "resume" in r:
  res = r["resume"]
  print(f"  resume kv vs recompute     {res['kv_us_per_held_token']:.2f} vs "
        f"{res['recompute_us_per_held_token']:.2f} us per held token")
PY
