"""The slot sampler: a static array of decode slots, refilled from a queue.

`generate` is the one-call entry point (`generate_on`: on an engine a run already has);
`SlotEngine` is the engine the APRIL rollout drives through the contract of contract.py
(admit, step, extend, snapshot, ...); `SampleRecord` is a sample on the host.
"""

from april_jax.sampler.engine import EngineConfig, SlotEngine
from april_jax.sampler.generate import generate, generate_on, sample_keys
from april_jax.sampler.records import PromptError, SampleRecord
from april_jax.sampler.sampling import sample_tokens
