#!/usr/bin/env bash
# Every benchmark mode on one NVIDIA GPU at real Qwen3 shapes (random weights), in parts,
# the quickest and most telling first; prints a short table at the end:
#   step        whole RL steps at the Qwen3-1.7B shape (STEP_CONFIG), APRIL vs the baseline,
#               alternating: rollout (decode, prefill, the rest), batch, learner, cast to
#               the decode params, checkpoint, each phase's seconds beside its floor from
#               the copy bandwidth, matmul rate and disk rate measured in the same run;
#               the learner's MFU and padded/real tokens (8 minutes at most: LIMIT_step);
#               first, the fast attention paths a run would take here (cuDNN, the Pallas
#               decode kernel) checked against the portable ones: which it verified and took
#   step_lora   the step part at the Qwen3-8B shape with LoRA adapters (rank 32, every
#               projection) over the frozen base, on the one GPU (STEP_LORA_CONFIG;
#               STEP_LORA_FLAGS adds flags); the learner's floor counts no base gradients
#   roofline    one chunk of paged decode attention compiled and timed at the 8B config's
#               per-device shapes (seconds): does this backend copy the gathered pages,
#               and what does that cost against the same pages read in place; and one
#               layer at the steady state through the XLA path and the Pallas kernel,
#               the engine's and a candidate (fewer, longer runs)
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
#   async       rollout and learner on their own devices vs colocated (ASYNC_CONFIG, the
#               long-tailed tiny task by default, ASYNC_STEPS steps): on a node both sides
#               on its GPUs; on one GPU the colocated side alone; either way the split a
#               node of ASYNC_NODE GPUs would gain, projected from the phase times measured
#   moe         the mixture-of-experts layer at Qwen3-30B-A3B's widths in bfloat16 (each
#               grouping against a dense feed-forward of the same active width, MOE_TOKENS
#               tokens), decode at its widths with 2 layers (bytes a step reads, of the
#               experts its tokens touch, over the copy bandwidth), and whole RL steps at
#               its shape with 4 layers (configs/gpu_bench.py:qwen3_30b_a3b_4l)
#   speculative speculative decoding vs plain decoding, the same keys (0 token mismatches
#               expected in float32): on the tiny task (SPEC_CONFIG), then at the Qwen3-1.7B
#               shape in bfloat16 with drafts from the true continuation wrong at a set rate,
#               at 1, 8 and 32 live slots (SPEC_LIVE): the speedup against acceptance
# Each part stops after PART_LIMIT seconds (default 300; LIMIT_<part> for one part, e.g.
# LIMIT_sampler=60; the step part's own default is 480), keeping what its log printed
# (each sampler stage is named on stderr as it starts), and the next part runs. On an
# H200 (2026-12-04) the sampler part at 0.6B and 4B with 512 new tokens did not finish in
# 6.5 minutes, so it now runs 0.6B alone at 256 new tokens.
#
#   bash launch/bench_gpu.sh                     # scheduler and resume at Qwen3-0.6B
#   MODEL=qwen3_4b bash launch/bench_gpu.sh      # ... at Qwen3-4B
#   PARTS="roofline sampler" bash launch/bench_gpu.sh   # some parts only, in this order
#   PARTS="roofline sampler scheduler resume" SAMPLER_MODELS=tiny TAIL_MODEL=tiny \
#       CONFIG=configs/tiny.py MAX_RESPONSE_LEN=64 bash launch/bench_gpu.sh   # CPU smoke run
#   PARTS=speculative SPEC_MODEL=small SPEC_LIVE=1,2 SPEC_RESPONSE_LEN=32 \
#       bash launch/bench_gpu.sh                                       # the speculative part, on a CPU
#   PARTS=step STEP_CONFIG=configs/tiny.py STEP_MAX_RESPONSE_LEN=32 STEP_STEPS=1 \
#       bash launch/bench_gpu.sh                                       # the step part, on a CPU
#   PARTS=step_lora STEP_LORA_CONFIG=configs/tiny.py STEP_LORA_FLAGS=--config.train.lora.rank=4 \
#       STEP_MAX_RESPONSE_LEN=32 STEP_STEPS=1 bash launch/bench_gpu.sh   # LoRA's, on a CPU
#   PARTS=moe MOE_WIDTHS=scaled MOE_TOKENS=256 MOE_SAMPLER_MODEL=small_moe NEW_TOKENS=64 \
#       MOE_STEP_CONFIG=configs/tiny_moe.py STEP_MAX_RESPONSE_LEN=32 STEP_STEPS=1 \
#       LIMIT_moe_sampler=900 bash launch/bench_gpu.sh                 # the moe part, on a CPU
#
# The step part: STEP_STEPS timed steps a side (default 3) at STEP_MAX_RESPONSE_LEN
# (default 1,024: the 1.7B config's pools, two engines and the learner fit an 80 GB GPU),
# DAPO-like lengths; STEP_FLAGS adds flags, e.g. on an H200
#   STEP_CONFIG=configs/gpu_bench.py:qwen3_4b \
#       STEP_FLAGS="--config.rollout.kv_pages=320 --config.train.num_microbatches=32"
# (compiled at those shapes, python -m april_jax.plan --compile --devices=1
# --device_memory_gb=141 with the same flags and --config.rollout.max_response_len=1024
# --config.data.max_prompt_len=16: a 110.7 GB peak, 122.9 GB with the second pool;
# 640 pages would need about 150).
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
PARTS=${PARTS:-step moe speculative step_lora scheduler roofline tail_kernel sampler_kernel tail sampler resume sampler_4b}
mkdir -p "$OUT" "$REPORTS"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
CONFIG=${CONFIG:-configs/gpu_bench.py:${MODEL}}
SAMPLER_MODELS=${SAMPLER_MODELS:-qwen3_0_6b}
NEW_TOKENS=${NEW_TOKENS:-256}
PART_LIMIT=${PART_LIMIT:-300}  # seconds; a part past it is stopped and the next one runs
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-2048}
STEP_CONFIG=${STEP_CONFIG:-configs/gpu_bench.py:qwen3_1_7b}
STEP_STEPS=${STEP_STEPS:-3}
STEP_MAX_RESPONSE_LEN=${STEP_MAX_RESPONSE_LEN:-1024}
LIMIT_step=${LIMIT_step:-480}  # the step part compiles the learner too
STEP_LORA_CONFIG=${STEP_LORA_CONFIG:-configs/gpu_bench.py:qwen3_8b_lora}
LIMIT_step_lora=${LIMIT_step_lora:-480}
MOE_SAMPLER_MODEL=${MOE_SAMPLER_MODEL:-qwen3_30b_a3b_2l}
MOE_STEP_CONFIG=${MOE_STEP_CONFIG:-configs/gpu_bench.py:qwen3_30b_a3b_4l}

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
    # Whole RL steps, both sides alternating, each phase beside its floor.
    # shellcheck disable=SC2086  # STEP_FLAGS: several flags, split on spaces
    step) run step --mode=step --config="$STEP_CONFIG" --dist=dapo_math --steps="$STEP_STEPS" \
        --max_response_len="$STEP_MAX_RESPONSE_LEN" ${STEP_FLAGS:-} ;;
    # The same at the 8B shape with LoRA (train.lora) on the one GPU.
    # shellcheck disable=SC2086
    step_lora) run step_lora --mode=step --config="$STEP_LORA_CONFIG" --dist=dapo_math \
        --steps="$STEP_STEPS" --max_response_len="$STEP_MAX_RESPONSE_LEN" ${STEP_LORA_FLAGS:-} ;;
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
    # Overlapped rollout and learner (several GPUs), and the projection to a node.
    async) run async --mode=async --config="${ASYNC_CONFIG:-configs/tiny_tail.py}" \
        --steps="${ASYNC_STEPS:-12}" --node_devices="${ASYNC_NODE:-8}" ;;
    moe) run moe --mode=moe_layer --moe_widths="${MOE_WIDTHS:-real}" --dtype=bfloat16 \
        --moe_tokens="${MOE_TOKENS:-16384}" --repeats=3
      run moe_sampler --mode=sampler --models="$MOE_SAMPLER_MODEL" --hf=false --dtype=bfloat16 \
        --batch=64 --prompt_len=256 --new_tokens="$NEW_TOKENS" --repeats=1 --tail_model=
      # shellcheck disable=SC2086
      run moe_step --mode=step --config="$MOE_STEP_CONFIG" --dist=dapo_math \
        --steps="$STEP_STEPS" --max_response_len="$STEP_MAX_RESPONSE_LEN" ${MOE_STEP_FLAGS:-} ;;
    speculative) run speculative --mode=speculative --config="${SPEC_CONFIG:-configs/tiny.py}" \
        --spec_model="${SPEC_MODEL:-qwen3_1_7b}" --spec_live="${SPEC_LIVE:-1,8,32}" \
        --spec_tokens="${SPEC_TOKENS:-4}" --dtype=bfloat16 \
        --config.rollout.max_response_len="${SPEC_RESPONSE_LEN:-256}" ;;
    scheduler) run scheduler --mode=scheduler --config="$CONFIG" --dist=deepmath --steps=4 \
        --max_response_len="$MAX_RESPONSE_LEN" ;;
    resume) run resume --mode=resume --config="$CONFIG" --dist=deepmath --steps=3 \
        --max_response_len=$((MAX_RESPONSE_LEN / 2)) ;;
    *) echo "bench_gpu.sh: unknown part '$part' in PARTS (step step_lora roofline sampler" \
         "sampler_kernel tail tail_kernel scheduler resume sampler_4b async speculative moe)" >&2
       exit 2 ;;
  esac
done

python - "$OUT" "$CONFIG" "$SAMPLER_MODELS" "$PARTS" "$STEP_CONFIG" "$STEP_LORA_CONFIG" \
    "$MOE_SAMPLER_MODEL" "$MOE_STEP_CONFIG" <<'PY'
import json, sys
out, model, sampler_models, parts = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
step_config, step_lora_config = sys.argv[5], sys.argv[6]
moe_sampler_model, moe_step_config = sys.argv[7], sys.argv[8]
def load(name):
  try:
    return json.loads(open(f"{out}/{name}.log").read().strip().splitlines()[-1])
  except (OSError, IndexError, ValueError):
    print(f"{name}: did not finish (see its log)")
    return None
r = {name: res for name in parts.split() if (res := load(name)) is not None}
if "moe" in parts.split():  # the moe part's decode and step runs have logs of their own
  r.update({n: res for n in ("moe_sampler", "moe_step") if (res := load(n)) is not None})
kinds = [v["machine"]["device_kind"] for v in r.values() if "machine" in v]
print(f"\non {kinds[0] if kinds else r.get('roofline', {}).get('backend', '?')}")
for part, step_cfg in (("step", step_config), ("step_lora", step_lora_config),
                       ("moe_step", moe_step_config)):
  if part not in r:
    continue
  st = r[part]
  print(f"{step_cfg}, whole RL steps ({st['steps']} a side, max_len {st['max_response_len']}): "
        f"APRIL {st['april_phases']['step']:.2f} s vs baseline {st['baseline_phases']['step']:.2f} "
        f"s a step ({st['step_speedup']:.2f}x; rollout tokens/s {st['rollout_speedup']:.2f}x)")
  print(f"  {'phase':<14}{'APRIL s':>9}{'of floor':>9}{'baseline s':>11}{'of floor':>9}")
  for phase in ("rollout", "decode", "prefill", "rollout_other", "batch", "learner", "cast",
                "checkpoint", "step"):
    cells = []
    for side in ("april", "baseline"):
      seconds, floor = st[f"{side}_phases"][phase], st[f"{side}_floors"].get(phase)
      cells.append((seconds, "-" if floor is None else f"{floor / seconds:.0%}"))
    print(f"  {phase:<14}{cells[0][0]:>9.3f}{cells[0][1]:>9}{cells[1][0]:>11.3f}{cells[1][1]:>9}")
  c, mfu = st["ceilings"], st["learner_mfu"]
  print(f"  learner MFU (of {c['matmul_tflops']:,.1f} TFLOP/s measured): APRIL "
        f"{mfu['april']['padded']:.0%} ({mfu['april']['real']:.0%} over real tokens), baseline "
        f"{mfu['baseline']['padded']:.0%} ({mfu['baseline']['real']:.0%}); padded/real "
        f"{st['padded_per_real']['april']:.2f} / {st['padded_per_real']['baseline']:.2f}; "
        f"outside rollout and learner {st['outside_rollout_learner_frac']['april']:.0%} / "
        f"{st['outside_rollout_learner_frac']['baseline']:.0%} of a step")
  print(f"  copy {c['copy_gbps']:,.0f} GB/s, disk {c['disk_mb_per_s']:,.0f} MB/s; compilations "
        f"while timed: {st['compiles_while_timed']}")
  fast = st.get("fast_paths")
  if fast:
    print(f"  fast paths: verified {', '.join(fast['verified']) or 'none'}; taken "
          + ", ".join(f"{kind} {impl}" for kind, impl in fast["taken"].items())
          + "".join(f"; fell back: {line}" for line in fast["warnings"]))
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
if "moe" in r:
  m = r["moe"]
  widths = "" if m["timed_at"] == "real" else "a quarter of "
  print(f"mixture-of-experts layer at {widths}Qwen3-30B-A3B's widths, {m['tokens']} tokens "
        f"({m['dtype']}): " + ", ".join(
            f"experts ({impl}) {m[impl + '_ms']:.2f} ms = {m[impl + '_over_dense']:.2f}x"
            for impl in ("blocks", "ragged")) + f" a dense layer's {m['dense_ms']:.2f} ms")
for part, models in (
    ("sampler", sampler_models), ("sampler_kernel", ["qwen3_0_6b"]), ("sampler_4b", ["qwen3_4b"]),
    ("moe_sampler", [moe_sampler_model]), ("tail", []), ("tail_kernel", [])):
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
if "speculative" in r:
  sp = r["speculative"]
  t = sp["task"]
  print(f"speculative (K={sp['K']}): task {t['speculative']['ms_per_token']:.3f} vs plain "
        f"{t['plain']['ms_per_token']:.3f} ms/token, {t['mismatches']['samples_differing']} "
        f"samples differ (float32); bfloat16 {sp['bfloat16']['samples_differing']} differ")
  for row in sp["controlled"]:
    print(f"  {sp['controlled_model']}: {row['live']:>3} live, wrong {row['wrong_rate']:.1f}: "
          f"acceptance {row['acceptance']:.2f}, {row['tokens_per_pass']:.2f} tokens a pass, "
          f"{row['speedup']:.2f}x ({row['faster']})")
if "async" in r:
  a = r["async"]
  if "speedup" in a:
    print(f"async: split vs colocated {a['speedup']:.2f}x per trained batch on {a['devices']}")
  p = a["projection"]
  for key, chosen in p.items():
    if key.startswith("scaling_") and chosen["chosen"]:
      row = next(x for x in chosen["splits"] if x["rollout_devices"] == chosen["chosen"])
      print(f"async: projected to {p['node_devices']} GPUs, rollout scaling {key[8:]}: "
            f"{row['speedup']:.2f}x at rollout_devices={chosen['chosen']}")
PY
