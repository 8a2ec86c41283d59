"""LoRA adapters as a PEFT folder: peft loads what we write onto the base model
transformers saved and gives the logits of our merged model; we read it back exactly;
a folder that does not fit the base is refused, naming what differs."""

import json

import jax
import numpy as np
import pytest

from april_jax.models import hf_io, lora, peft_io, qwen3
from conftest import TINY_HF_CONFIGS, save_random_hf_qwen3
import hf_oracle

SPEC = lora.LoraSpec(rank=4, alpha=8.0)


def _adapters(cfg, spec=SPEC, seed=1):
  """Random adapters with nonzero B (a trained adapter, not step 0's)."""
  adapters = lora.init(cfg, spec, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), len(spec.targets)))
  for ad in adapters["layers"].values():
    ad["b"] = 0.2 * jax.random.normal(next(keys), ad["b"].shape)
  return adapters


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("base")
  return save_random_hf_qwen3(path, **TINY_HF_CONFIGS["head_dim_decoupled"])


@pytest.mark.parametrize("targets", [lora.TARGETS, ("q", "v"), ("o", "down")])
def test_peft_loads_our_adapters_onto_the_base_and_gives_the_merged_logits(
    base_dir, tmp_path, targets
):
  hf_oracle.require("torch", "transformers", "peft")
  cfg, params = hf_io.load_pretrained(base_dir)
  spec = lora.LoraSpec(rank=4, alpha=8.0, targets=targets)
  adapters = _adapters(cfg, spec)
  peft_io.save_peft(tmp_path / "adapter", spec, adapters, base_model=str(base_dir))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
  ours = np.asarray(qwen3.forward(cfg, lora.merge(params, adapters, spec), tokens))
  theirs = hf_oracle.logits(base_dir, tokens, adapter_dir=tmp_path / "adapter")
  np.testing.assert_allclose(ours, theirs, rtol=2e-4, atol=2e-4)
  base = np.asarray(qwen3.forward(cfg, params, tokens))
  assert np.abs(ours - base).max() > 1e-2  # the adapters change the logits


def test_a_peft_folder_reads_back_exactly(base_dir, tmp_path):
  cfg = hf_io.load_config(base_dir)
  adapters = _adapters(cfg)
  peft_io.save_peft(tmp_path, SPEC, adapters)
  spec, back = peft_io.load_peft(tmp_path, cfg)
  assert spec == SPEC
  for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), b)


def _edit_config(path, **changes):
  config = json.loads((path / peft_io.CONFIG_NAME).read_text())
  config.update(changes)
  (path / peft_io.CONFIG_NAME).write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(peft_type="IA3"), "peft_type is 'IA3', not 'LORA'"),
        (dict(target_modules=["q_proj", "qkv"]), r"target_modules \['qkv'\] are not Qwen3"),
        (dict(target_modules="all-linear"), "target_modules is a pattern"),
        (dict(use_rslora=True), "use_rslora=true is not supported"),
        (dict(r=2), r"lora_A.weight has shape \(4, 64\); this base model needs \(2, 64\)"),
    ],
)
def test_a_folder_that_does_not_fit_the_base_is_refused_naming_what_differs(
    base_dir, tmp_path, changes, message
):
  cfg = hf_io.load_config(base_dir)
  peft_io.save_peft(tmp_path, SPEC, _adapters(cfg))
  _edit_config(tmp_path, **changes)
  with pytest.raises(peft_io.AdapterError, match=message):
    peft_io.load_peft(tmp_path, cfg)


def test_adapters_of_another_architecture_are_refused(base_dir, tmp_path):
  other = qwen3.Qwen3Config(**{**hf_io.load_config(base_dir).__dict__, "hidden_size": 32})
  peft_io.save_peft(tmp_path, SPEC, _adapters(other))
  with pytest.raises(peft_io.AdapterError, match="this base model needs"):
    peft_io.load_peft(tmp_path, hf_io.load_config(base_dir))
