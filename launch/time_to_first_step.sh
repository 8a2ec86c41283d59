#!/usr/bin/env bash
# Seconds from launch to the first step's progress line, for a fresh run and for a resume
# of it, with XLA's persistent compilation cache off and on (the default: <workdir>/xla_cache).
#   bash launch/time_to_first_step.sh [config]      (default configs/tiny.py)
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-configs/tiny.py}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
unset JAX_COMPILATION_CACHE_DIR  # the run's own setting decides

first_step() {  # workdir num_steps extra-flag -> seconds to the first "step" line
  local t0; t0=$(date +%s.%N)
  python -m april_jax.main --config="$config" --workdir="$1" --config.num_steps="$2" \
      --config.eval_every=0 "$3" 2>/dev/null | while read -r line; do
    case "$line" in step*) echo "$(date +%s.%N) - $t0" | bc; break ;; esac
  done
}

printf '%-8s %12s %12s\n' cache fresh_s resume_s
for mode in off on; do
  flag="--config.compilation_cache_dir="
  [ "$mode" = on ] && flag="--config.log_every=1"  # leaves the cache at its default
  fresh=$(first_step "$tmp/$mode" 1 "$flag")
  resume=$(first_step "$tmp/$mode" 2 "$flag")
  printf '%-8s %12.1f %12.1f\n' "$mode" "$fresh" "$resume"
done
