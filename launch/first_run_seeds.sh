#!/usr/bin/env bash
# The README's first run on three seeds: held-out greedy pass@1 before RL and after it,
# APRIL's partial samples carried per step and off-policy token fraction (means over the
# steps), and each run's wall time (launch to exit, warm-start and compilation included).
#   bash launch/first_run_seeds.sh [config] [seeds...]     (default configs/tiny.py 0 1 2)
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-configs/tiny.py}"
shift || true
seeds=("${@:-0 1 2}")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

printf '%-6s %14s %14s %9s %11s %8s\n' seed pass@1_before pass@1_after partials off_policy wall_s
for seed in ${seeds[*]}; do
  t0=$(date +%s.%N)
  python -m april_jax.main --config="$config" --workdir="$tmp/$seed" --config.seed="$seed" \
      >/dev/null 2>&1
  wall=$(echo "$(date +%s.%N) - $t0" | bc)
  python - "$tmp/$seed/metrics.jsonl" "$seed" "$wall" <<'PY'
import json, sys
path, seed, wall = sys.argv[1], sys.argv[2], float(sys.argv[3])
lines = [json.loads(line) for line in open(path, encoding="utf-8")]
evals = [l for l in lines if "eval/pass@1" in l]
steps = [l for l in lines if l["step"] >= 1]
mean = lambda key: sum(l[key] for l in steps) / len(steps)
print(
    f"{seed:<6} {evals[0]['eval/pass@1']:14.3f} {evals[-1]['eval/pass@1']:14.3f} "
    f"{mean('rollout/partial_samples'):9.1f} {mean('rollout/off_policy_token_frac'):11.2f} "
    f"{wall:8.0f}"
)
PY
done
