"""Mode multiturn (april_jax/benchmarks/multiturn_bench.py): three sides over the same
drawn tokens, each through the scheduler."""

from april_jax.benchmarks import multiturn_bench

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2)
TINY.update(num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def test_the_three_sides_draw_the_same_tokens_and_only_the_engine_side_prefills():
  shape = multiturn_bench.Shape(
      episodes=4, slots=2, turns=3, turn_tokens=8, obs_tokens=20, tool_s=0.01, prompt_len=6
  )
  r = multiturn_bench.run(shape, repeats=1, model=TINY)
  single, engine, before = r["single"], r["engine"], r["before"]
  sides = (single, r["long_single"], engine, before)
  assert [x["samples"] for x in sides] == [4] * 4
  assert len({x["drawn_tokens"] for x in sides}) == 1 and single["drawn_tokens"] > 0
  # Two observations an episode of 20 tokens: prefilled on one side, fed step by step on
  # the other, where they cost decode steps.
  assert engine["observation_tokens"] == before["observation_tokens"] > 0
  assert engine["tokens_fed"] == engine["observation_tokens"] and before["feeds"] == 0
  assert engine["decode_steps"] < before["decode_steps"]
  assert engine["turns"] == before["turns"] == 12
  assert r["prefill_s"] > 0 and 0 <= r["engine_idle_frac"] < 1
