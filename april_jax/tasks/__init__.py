"""What a run trains on: the built-in long-tail task (longtail.py) and a run's task from its
config (task.py: prompts, reward, held-out items, warm-start data, tokenizer)."""

# The built-in task registers its rewards ("longtail", "lookup") when imported.
from april_jax.tasks import longtail  # noqa: F401  pylint: disable=unused-import
