"""The rollout metrics of docs/design.md, computed from one step's result.

Definitions (exact; tests check them against hand counts). A multi-turn episode's
response holds the environment's observations too: they count in the response lengths
and trained_tokens_per_s, nowhere else (they are given, not drawn or trained).
  tokens_per_s           new tokens drawn this step by all slots (including tokens
                         of samples that finish in a later step) / rollout wall time
  trained_tokens_per_s   response tokens in the training batch / rollout wall time
  slot_occupancy         kept tokens / (num_slots x decode steps); with speculation a
                         step (a verify pass) may yield several tokens a slot, so it
                         may pass 1
  tokens_per_decode_step new tokens / decode steps (passes over the slots)
  spec/*                 with speculation (rollout.speculative_tokens > 0), this step's
                         drafts checked (spec/drafted), accepted (spec/accepted), the
                         accepted drafts per slot pass that checked any
                         (spec/accepted_per_verify), and by source (drafts.py: own,
                         group, history, suggested) spec/acceptance/<source> = accepted / drafted;
                         spec/draft_failures: a draft source that failed on the host
                         (counted; the slot drafted without it)
  off_policy_token_frac  the APRIL paper's measure (its Figure 4): batch response tokens
                         of samples cut at an earlier step's end and continued / all
                         batch response tokens
  stale_token_frac       batch response tokens whose version tag is older than the
                         current version / all batch response tokens. The tag is the
                         oldest params a token's forward pass saw (sampler/state.py):
                         finished siblings and surplus groups from earlier steps count,
                         and so does a continuation drawn by the current params over KV
                         that older params computed (resume mode kv); one whose KV was
                         recomputed by the current params does not
  staleness_{max,mean}   per trained sample: current version - its oldest token's tag
  lag_token_{mean,max}   per trained (drawn) token: current version - its tag
  stale_restarts         samples restarted from the prompt for exceeding max_staleness
  overdue_groups         groups holding such a restart: the step waited for them
  preemptions            live samples moved out of their slots because the KV page pool
                         ran out (continued later as partials; never dropped)
  kv_pages_used_frac     pool pages held at the step's end of decoding / usable pages
  env/*                  with an environment, this step's counts: turns, episodes_done,
                         errors, timeouts, turn_limit, observations_cut, out_of_budget,
                         observation_tokens (rollout/episodes.py)
  observation_token_frac batch response tokens that are observations / all of them
"""

from __future__ import annotations

import numpy as np

from april_jax.rollout.scheduler import RolloutResult


def rollout_metrics(result: RolloutResult, version: int) -> dict[str, float]:
  st = result.stats
  samples = [s for g in result.groups for s in g.samples]
  lengths = np.array([len(s.response) for s in samples], np.float64)
  drawn = [s.drawn_mask > 0 for s in samples]  # all of a response but observations
  versions = (
      np.concatenate([s.versions[d] for s, d in zip(samples, drawn)])
      if samples
      else np.zeros((0,), np.int32)
  )
  drawn_total = float(sum(d.sum() for d in drawn))
  continued = sum(d.sum() for s, d in zip(samples, drawn) if s.cuts > 0)
  staleness = np.array(
      [version - int(s.versions.min()) if len(s.versions) else 0 for s in samples], np.float64
  )
  rewards = np.array([r for g in result.groups for r in (g.rewards or [])], np.float64)
  in_group_std = [np.std([len(s.response) for s in g.samples]) for g in result.groups]
  wall = max(st.get("rollout_s", 0.0), 1e-9)
  stat = lambda fn, a: float(fn(a)) if len(a) else 0.0
  return _reward_extras(result.groups) | {
      "rollout/tokens_per_s": st.get("new_tokens", 0) / wall,
      "rollout/trained_tokens_per_s": float(lengths.sum()) / wall,
      **_decoding(st),
      "rollout/off_policy_token_frac": continued / drawn_total if drawn_total else 0.0,
      "rollout/stale_token_frac": stat(np.mean, versions < version),
      "rollout/staleness_max": stat(np.max, staleness),
      "rollout/staleness_mean": stat(np.mean, staleness),
      "rollout/lag_token_mean": stat(np.mean, version - versions),
      "rollout/lag_token_max": stat(np.max, version - versions),
      "rollout/partial_samples": float(st.get("partial_samples", 0)),
      "rollout/buffer_groups": float(st.get("buffer_groups", 0)),
      "rollout/buffer_bytes": float(st.get("buffer_bytes", 0)),
      "rollout/response_len_mean": stat(np.mean, lengths),
      "rollout/response_len_std": stat(np.std, lengths),
      "rollout/response_len_p50": stat(np.median, lengths),
      "rollout/response_len_max": stat(np.max, lengths),
      "rollout/response_len_std_in_group": stat(np.mean, np.array(in_group_std)),
      "rollout/reward_mean": stat(np.mean, rewards),
      "rollout/reward_std": stat(np.std, rewards),
      "rollout/zero_std_groups_dropped": float(st.get("zero_std_groups_dropped", 0)),
      "rollout/zero_std_groups_kept": float(st.get("zero_std_groups_kept", 0)),
      "rollout/truncated_frac": stat(
          np.mean, np.array([s.finish_reason == "length" for s in samples])
      ),
      "rollout/stale_restarts": float(st.get("stale_restarts", 0)),
      "rollout/overdue_groups": float(st.get("overdue_groups", 0)),
      "rollout/preemptions": float(st.get("preemptions", 0)),
      "rollout/kv_pages_used_frac": float(st.get("kv_pages_used_frac", 0.0)),
      "rollout/prompts_skipped": float(st.get("prompts_skipped", 0)),
      "rollout/reward_errors": float(st.get("reward_errors", 0)),
      "rollout/reward_timeouts": float(st.get("reward_timeouts", 0)),
      **{f"rollout/{k}": float(v) for k, v in st.items() if k.startswith("env/")},
      **_speculation(st),
      "rollout/observation_token_frac": 1.0 - drawn_total / lengths.sum() if lengths.sum() else 0.0,
      "time/rollout_s": float(st.get("rollout_s", 0.0)),
      "time/reward_s": float(st.get("reward_s", 0.0)),
      "time/env_wait_s": float(st.get("env_wait_s", 0.0)),
  }


def _decoding(st: dict) -> dict[str, float]:
  """rollout/slot_occupancy and rollout/tokens_per_decode_step."""
  tokens, steps = st.get("new_tokens", 0), st.get("decode_steps", 0)
  slot_steps = st.get("num_slots", 0) * steps
  return {
      "rollout/slot_occupancy": tokens / slot_steps if slot_steps else 0.0,
      "rollout/tokens_per_decode_step": tokens / steps if steps else 0.0,
  }


def _speculation(st: dict) -> dict[str, float]:
  """rollout/spec/*: the step's drafts, acceptance, and acceptance by source (only when
  the step drafted: runs without speculation log none)."""
  by = lambda kind: {k.split("/")[2]: v for k, v in st.items() if k.startswith(f"spec/{kind}/")}
  drafted, accepted, passes = by("drafted"), by("accepted"), by("draft_passes")
  failures = st.get("spec/draft_failures", 0)
  if not drafted and not failures:
    return {}
  total, right = sum(drafted.values()), sum(accepted.values())
  out = {
      "rollout/spec/draft_failures": float(failures),
      "rollout/spec/drafted": float(total),
      "rollout/spec/accepted": float(right),
      "rollout/spec/accepted_per_verify": right / max(sum(passes.values()), 1),
  }
  for source, n in drafted.items():
    out[f"rollout/spec/acceptance/{source}"] = accepted.get(source, 0) / n if n else 0.0
  return out


def _reward_extras(groups) -> dict[str, float]:
  """`reward/<key>`: the mean over the trained samples of each extra number a dict reward
  returned (samples without it left out)."""
  values: dict[str, list[float]] = {}
  for g in groups:
    for key, per_sample in g.reward_info.get("metrics", {}).items():
      values.setdefault(key, []).extend(v for v in per_sample if v == v)  # NaN: not given
  return {f"reward/{k}": float(np.mean(v)) for k, v in sorted(values.items()) if v}
