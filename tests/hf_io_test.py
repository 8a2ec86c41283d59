"""HF checkpoints in and out: transformers reads what we write; bad folders fail clearly."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from april_jax.models import hf_io, qwen3
from conftest import tiny_qwen3
import hf_oracle


def _tokens(vocab, shape=(2, 24), seed=0):
  return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def test_saved_checkpoint_loads_in_transformers_with_same_logits(hf_model_dir, tmp_path):
  cfg, params = hf_io.load_pretrained(hf_model_dir)
  hf_io.save_pretrained(tmp_path, cfg, params)
  hf_oracle.require("torch", "transformers")
  tokens = _tokens(cfg.vocab_size)
  theirs = hf_oracle.logits(tmp_path, tokens)
  ours = np.asarray(qwen3.forward_jit(cfg, params, jnp.asarray(tokens)))
  np.testing.assert_array_less(np.abs(ours - theirs).max(), 1e-4)
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved.get("tie_word_embeddings", False) == cfg.tie_word_embeddings


def test_load_save_load_is_identical_including_sharded_files(hf_model_dir, tmp_path):
  cfg, params = hf_io.load_pretrained(hf_model_dir)
  # A small shard cap forces several files and an index.
  hf_io.save_pretrained(tmp_path, cfg, params, max_shard_bytes=20_000)
  assert (tmp_path / hf_io.INDEX_NAME).is_file()
  assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
  cfg2, params2 = hf_io.load_pretrained(tmp_path)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_bfloat16_round_trip_keeps_dtype_and_values(tmp_path):
  cfg = tiny_qwen3(vocab_size=64, intermediate_size=48, num_heads=2, num_kv_heads=1, head_dim=16)
  params = qwen3.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
  umask = os.umask(0o022)
  try:
    hf_io.save_pretrained(tmp_path, cfg, params)
  finally:
    os.umask(umask)
  # Exported files are readable by all, as a plain open() makes them (not safetensors' 0600).
  assert {oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()} == {"0o644"}
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  _, params2 = hf_io.load_pretrained(tmp_path, dtype="bfloat16")
  jax.tree.map(
      lambda a, b: np.testing.assert_array_equal(
          np.asarray(a, np.float32), np.asarray(b, np.float32)
      ),
      params,
      params2,
  )


def test_config_reads_rope_theta_top_level_or_in_rope_parameters():
  base = dict(
      model_type="qwen3",
      vocab_size=8,
      hidden_size=8,
      intermediate_size=8,
      num_hidden_layers=1,
      num_attention_heads=2,
      num_key_value_heads=1,
      head_dim=4,
  )
  assert hf_io.config_from_hf({**base, "rope_theta": 123.0}).rope_theta == 123.0
  nested = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 456.0}}
  assert hf_io.config_from_hf(nested).rope_theta == 456.0


def test_released_qwen3_configs_parse_to_their_published_shapes():
  from conftest import MODEL_CONFIGS_DIR as folder  # pylint: disable=g-import-not-at-top

  c4 = hf_io.config_from_hf(json.loads((folder / "qwen3-4b.config.json").read_text()))
  c8 = hf_io.config_from_hf(json.loads((folder / "qwen3-8b.config.json").read_text()))
  assert (c4.hidden_size, c4.num_heads, c4.head_dim, c4.tie_word_embeddings) == (
      2560,
      32,
      128,
      True,
  )
  assert (c8.hidden_size, c8.num_layers, c8.tie_word_embeddings) == (4096, 36, False)
  assert 4.0e9 < c4.num_params() < 4.1e9 and 8.1e9 < c8.num_params() < 8.3e9


def test_missing_config_json_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf_io.load_pretrained(tmp_path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf_io.load_pretrained(tmp_path / "nope")


def test_missing_weights_is_a_clear_error(hf_model_dir, tmp_path):
  shutil.copy(hf_model_dir / "config.json", tmp_path / "config.json")
  with pytest.raises(FileNotFoundError, match="safetensors"):
    hf_io.load_pretrained(tmp_path)


def test_a_broken_config_json_or_safetensors_file_is_a_model_error_naming_it(
    hf_model_dir, tmp_path
):
  shutil.copytree(hf_model_dir, tmp_path / "a")
  (tmp_path / "a" / "config.json").write_text('{"model_type": "qwen3",')
  with pytest.raises(hf_io.ModelError, match=r"a/config.json is not valid JSON"):
    hf_io.load_pretrained(tmp_path / "a")
  shutil.copytree(hf_model_dir, tmp_path / "b")
  weights = tmp_path / "b" / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
  with pytest.raises(hf_io.ModelError, match=r"b/model.safetensors"):
    hf_io.load_pretrained(tmp_path / "b")
  weights.write_bytes(b"\x00" * 64)  # not safetensors at all
  with pytest.raises(hf_io.ModelError, match=r"b/model.safetensors is not a readable"):
    hf_io.load_pretrained(tmp_path / "b")


@pytest.mark.parametrize(
    "model_type,message",
    [
        ("llama", "unsupported model_type 'llama'"),
        ("qwen3_moe", r"missing required field\(s\) \['num_experts', 'num_experts_per_tok'"),
    ],
)
def test_unsupported_architecture_is_named(hf_model_dir, tmp_path, model_type, message):
  shutil.copytree(hf_model_dir, tmp_path, dirs_exist_ok=True)
  config = json.loads((tmp_path / "config.json").read_text())
  config["model_type"] = model_type
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=message):
    hf_io.load_pretrained(tmp_path)


def test_wrong_tensor_shape_names_the_tensor(hf_model_dir, tmp_path):
  shutil.copytree(hf_model_dir, tmp_path, dirs_exist_ok=True)
  config = json.loads((tmp_path / "config.json").read_text())
  config["intermediate_size"] += 8  # now every MLP tensor disagrees with the config
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*shape"):
    hf_io.load_pretrained(tmp_path)


def test_a_malformed_config_index_or_a_missing_tensor_is_a_model_error_naming_it(
    hf_model_dir, tmp_path
):
  """Each was a bare KeyError, TypeError or AttributeError with a traceback."""
  from safetensors.numpy import load_file, save_file  # pylint: disable=g-import-not-at-top

  def broken(name, **config_changes):
    shutil.copytree(hf_model_dir, tmp_path / name)
    if config_changes:
      config = json.loads((tmp_path / name / "config.json").read_text())
      (tmp_path / name / "config.json").write_text(json.dumps({**config, **config_changes}))
    return tmp_path / name

  folder = broken("list")
  (folder / "config.json").write_text("[1, 2]")
  with pytest.raises(hf_io.ModelError, match="list/config.json: a JSON object was expected"):
    hf_io.load_pretrained(folder)
  folder = broken("string_layers", num_hidden_layers="2")
  with pytest.raises(hf_io.ModelError, match="num_hidden_layers must be a positive integer"):
    hf_io.load_pretrained(folder)
  folder = broken("no_weight_map")
  (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
  with pytest.raises(hf_io.ModelError, match="is not a safetensors index: KeyError"):
    hf_io.load_pretrained(folder)
  folder = broken("missing_tensor")
  tensors = load_file(str(folder / "model.safetensors"))
  del tensors["model.norm.weight"]
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf_io.ModelError, match="tensor 'model.norm.weight' is missing"):
    hf_io.load_pretrained(folder)
  folder = broken("llama", model_type="llama")
  with pytest.raises(hf_io.ModelError) as info:
    hf_io.load_pretrained(folder)
  assert str(info.value).count("config.json") == 1
