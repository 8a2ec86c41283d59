"""Side-by-side benchmarks: `python -m april_jax.bench --mode=sampler [...]`.

Each mode measures both sides in one run and prints a readable table, then, as its last
stdout line, one JSON object with every number.

  sampler    april_jax decode vs transformers' generate; snapshot/restore kv vs recompute
"""

from absl import app
from absl import flags

from april_jax.benchmarks import common

_MODE = flags.DEFINE_enum("mode", "sampler", ["sampler"], "What to measure.")
_MODELS = flags.DEFINE_list("models", ["tiny", "small"], "sampler: model sizes to run.")
_BATCH = flags.DEFINE_integer("batch", 16, "sampler: sequences decoded together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "sampler: prompt tokens.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "sampler: tokens generated each.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (best is reported).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weights and prompts.")


def main(argv):
  del argv
  if _MODE.value == "sampler":
    from april_jax.benchmarks import sampler_bench  # pylint: disable=g-import-not-at-top
    result = sampler_bench.run(models=_MODELS.value, batch=_BATCH.value, prompt_len=_PROMPT_LEN.value,
                               new_tokens=_NEW_TOKENS.value, repeats=_REPEATS.value,
                               seed=_SEED.value)
  common.emit(result)


if __name__ == "__main__":
  app.run(main)
