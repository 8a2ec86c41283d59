#!/usr/bin/env bash
# The tiny config's first run with each advantage estimator, APRIL on and off: held-out
# greedy pass@1 before RL and after it, and each run's wall time (launch to exit).
#   bash launch/advantage_runs.sh [seed] [estimators...]
#       (default seed 0; grpo reinforce_plus_plus reinforce_plus_plus_baseline rloo gae)
# APRIL off is the synchronous baseline: partial_rollout=False, N' = N = 8.
# gae is PPO with a learned critic (critic lr 1e-3; no dynamic sampling, which a critic's
# nonzero advantages for groups of equal rewards make wasteful: validation refuses it).
set -euo pipefail
cd "$(dirname "$0")/.."
seed="${1:-0}"
shift || true
estimators=("${@:-grpo reinforce_plus_plus reinforce_plus_plus_baseline rloo gae}")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

printf '%-30s %-6s %14s %14s %8s\n' advantage april pass@1_before pass@1_after wall_s
for adv in ${estimators[*]}; do
  for april in on off; do
    flags=(--config.train.advantage="$adv" --config.seed="$seed")
    if [[ "$adv" == gae ]]; then
      flags+=(--config.train.critic_lr=1e-3 --config.rollout.dynamic_sampling=False)
    fi
    if [[ "$april" == off ]]; then
      flags+=(--config.rollout.partial_rollout=False --config.rollout.over_sampling_batch_size=8)
    fi
    t0=$(date +%s.%N)
    python -m april_jax.main --config=configs/tiny.py --workdir="$tmp/$adv-$april" \
        "${flags[@]}" >/dev/null 2>&1
    wall=$(echo "$(date +%s.%N) - $t0" | bc)
    python - "$tmp/$adv-$april/metrics.jsonl" "$adv" "$april" "$wall" <<'PY'
import json, sys
path, adv, april, wall = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
evals = [l for l in map(json.loads, open(path, encoding="utf-8")) if "eval/pass@1" in l]
print(f"{adv:<30} {april:<6} {evals[0]['eval/pass@1']:14.3f} {evals[-1]['eval/pass@1']:14.3f} {wall:8.0f}")
PY
  done
done
