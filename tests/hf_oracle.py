"""transformers and peft as the reference for parity tests, run in a process of their own.

A test process never loads torch: in processes that had loaded it, XLA's CPU compiler
has crashed (segfaults while compiling or serialising a program), the cause not found.
The first call starts `python hf_oracle.py` (one per test process, ended with it), which
loads torch, transformers and peft once and answers requests one at a time, each a JSON
line on its stdin, writing the request's arrays to an .npz file it names:

  logits(model_dir, tokens, adapter_dir=None, disable_adapter=False) -> float32 [B, T, V]
  generate(model_dir, prompts, max_new_tokens, eos) -> one list of new tokens per prompt
  save_random(path, **kwargs)                        (conftest.save_random_hf_qwen3)
  moe_block(x, router, gate, up, down, top_k, norm)  -> (Qwen3-MoE's sparse block on x
                                                        [T, D], its load-balancing loss)
  encode(tokenizer_dir, texts)                       -> one list of ids per text
  chat(tokenizer_dir, cases)                         -> (text, ids) per (messages,
                                                        add_generation_prompt,
                                                        enable_thinking[, tools])

`require("torch", "transformers")` skips a test, with the reason, where a package is
not installed (asked of its metadata, without importing it).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np


def require(*packages: str) -> None:
  """Skips the calling test when one of the packages is not installed."""
  import pytest  # pylint: disable=g-import-not-at-top

  for name in packages:
    try:
      importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
      pytest.skip(f"{name} is not installed (the reference for this parity test)")


class _Oracle:
  """The oracle's process, started at the first request: a request is a line of JSON
  (the request and the .npz path for its arrays), its answer a line of JSON (an error's
  traceback, or none)."""

  def __init__(self):
    self._proc = None
    self._log = None
    self._lock = threading.Lock()

  def ask(self, request: dict) -> dict[str, np.ndarray]:
    with self._lock, tempfile.TemporaryDirectory() as folder:
      out = Path(folder) / "out.npz"
      proc = self._started()
      try:
        proc.stdin.write(json.dumps({"request": request, "out": str(out)}) + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
      except (BrokenPipeError, OSError):
        answer = ""
      if not answer:  # it died: the next request starts another
        proc.wait()
        self._proc = None
        raise RuntimeError(
            f"hf_oracle {request['op']} died (exit {proc.returncode}):\n" f"{self._stderr_tail()}"
        )
      error = json.loads(answer)["error"]
      if error:
        raise RuntimeError(f"hf_oracle {request['op']} failed:\n{error[-4000:]}")
      with np.load(out) as arrays:
        return {k: arrays[k] for k in arrays.files}

  def _started(self) -> subprocess.Popen:
    if self._proc is None:
      env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
      self._log = tempfile.TemporaryFile()
      self._proc = subprocess.Popen(
          [sys.executable, __file__],
          stdin=subprocess.PIPE,
          stdout=subprocess.PIPE,
          stderr=self._log,
          text=True,
          env=env,
      )
      atexit.register(self.close)
    return self._proc

  def _stderr_tail(self) -> str:
    self._log.seek(0)
    return self._log.read().decode(errors="replace")[-4000:]

  def close(self) -> None:
    if self._proc is not None:
      self._proc.stdin.close()
      self._proc.wait(timeout=60)
      self._proc = None


_ORACLE = _Oracle()


def _run(request: dict) -> dict[str, np.ndarray]:
  return _ORACLE.ask(request)


def logits(model_dir, tokens, adapter_dir=None, disable_adapter=False) -> np.ndarray:
  request = dict(op="logits", model_dir=str(model_dir), tokens=np.asarray(tokens).tolist())
  request.update(adapter_dir=adapter_dir and str(adapter_dir), disable_adapter=disable_adapter)
  return _run(request)["logits"]


def generate(model_dir, prompts, max_new_tokens: int, eos=None) -> list[list[int]]:
  request = dict(
      op="generate", model_dir=str(model_dir), prompts=[list(map(int, p)) for p in prompts]
  )
  request.update(max_new_tokens=int(max_new_tokens), eos=None if eos is None else int(eos))
  out = _run(request)
  return [out[f"new_{i}"].tolist() for i in range(len(prompts))]


def encode(tokenizer_dir, texts: list[str]) -> list[list[int]]:
  out = _run(dict(op="encode", tokenizer_dir=str(tokenizer_dir), texts=list(texts)))
  return json.loads(str(out["json"]))


def chat(tokenizer_dir, cases: list) -> list[tuple[str, list[int]]]:
  out = _run(dict(op="chat", tokenizer_dir=str(tokenizer_dir), cases=list(cases)))
  return [(text, ids) for text, ids in json.loads(str(out["json"]))]


def moe_block(x, router, gate, up, down, top_k: int, norm: bool):
  """transformers' Qwen3MoeSparseMoeBlock and load_balancing_loss_func on tokens x [T, D],
  with the router [D, E] and the experts' gate and up [E, D, F] and down [E, F, D]."""
  arrays = dict(x=x, router=router, gate=gate, up=up, down=down)
  request = {k: np.asarray(v, np.float32).tolist() for k, v in arrays.items()}
  out = _run(dict(op="moe_block", top_k=int(top_k), norm=bool(norm), **request))
  return out["out"], float(out["aux"])


def save_random(path, **kwargs) -> Path:
  _run(dict(op="save_random", path=str(path), kwargs=kwargs))
  return Path(path)


# ------------------------------------------------------------- in the oracle's process
def _model(model_dir: str, adapter_dir: str | None):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  model = model.eval()
  if adapter_dir:
    import peft  # pylint: disable=g-import-not-at-top

    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
  return model


def _logits(r: dict) -> dict:
  import contextlib  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  model = _model(r["model_dir"], r["adapter_dir"])
  off = model.disable_adapter() if r["disable_adapter"] else contextlib.nullcontext()
  with torch.no_grad(), off:
    return {"logits": model(torch.tensor(r["tokens"])).logits.numpy()}


def _generate(r: dict) -> dict:
  import torch  # pylint: disable=g-import-not-at-top

  model, out = _model(r["model_dir"], None), {}
  for i, prompt in enumerate(r["prompts"]):
    with torch.no_grad():
      ids = model.generate(
          torch.tensor([prompt]),
          max_new_tokens=r["max_new_tokens"],
          do_sample=False,
          eos_token_id=r["eos"],
          pad_token_id=0,
      )
    out[f"new_{i}"] = ids[0, len(prompt) :].numpy()
  return out


def _save_random(r: dict) -> dict:
  """A random Qwen3ForCausalLM (Qwen3MoeForCausalLM given num_experts) saved by
  transformers, weights at realistic magnitudes (conftest.save_random_hf_qwen3 gives the
  arguments)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  kwargs = dict(r["kwargs"])
  seed = kwargs.pop("seed")
  torch.manual_seed(seed)
  if "num_experts" in kwargs:
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs))
  else:
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs))
  model = model.to(torch.float32)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      elif "embed_tokens" in name:
        p.normal_(0.0, 1.0)
      else:
        p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)  # [out, in] and experts' [E, out, in]
  model.save_pretrained(r["path"], safe_serialization=True)
  return {}


def _moe_block(r: dict) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import Qwen3MoeConfig  # pylint: disable=g-import-not-at-top
  from transformers.models.qwen3_moe import modeling_qwen3_moe as hf  # pylint: disable=g-import-not-at-top

  a = {k: np.asarray(r[k], np.float32) for k in ("x", "router", "gate", "up", "down")}
  (num_experts, hidden, width), top_k = a["gate"].shape, r["top_k"]
  config = Qwen3MoeConfig(
      hidden_size=hidden,
      moe_intermediate_size=width,
      num_experts=num_experts,
      num_experts_per_tok=top_k,
      norm_topk_prob=r["norm"],
  )
  block = hf.Qwen3MoeSparseMoeBlock(config).float()
  gate_up = np.concatenate([np.swapaxes(a["gate"], 1, 2), np.swapaxes(a["up"], 1, 2)], axis=1)
  with torch.no_grad():
    block.gate.weight.copy_(torch.tensor(a["router"].T))
    block.experts.gate_up_proj.copy_(torch.tensor(gate_up))
    block.experts.down_proj.copy_(torch.tensor(np.swapaxes(a["down"], 1, 2)))
    x = torch.tensor(a["x"])
    out = block(x[None])[0].numpy()
    logits = torch.nn.functional.linear(x, block.gate.weight)
    aux = hf.load_balancing_loss_func((logits,), num_experts=num_experts, top_k=top_k)
  return {"out": out, "aux": np.float32(aux)}


def _tokenizer(r: dict):
  import transformers  # pylint: disable=g-import-not-at-top

  return transformers.AutoTokenizer.from_pretrained(r["tokenizer_dir"])


def _encode(r: dict) -> dict:
  tok = _tokenizer(r)
  return {"json": np.array(json.dumps([tok(t)["input_ids"] for t in r["texts"]]))}


def _chat(r: dict) -> dict:
  tok, out = _tokenizer(r), []
  for messages, add_generation_prompt, enable_thinking, *tools in r["cases"]:
    kw = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    if tools and tools[0] is not None:
      kw["tools"] = tools[0]
    text = tok.apply_chat_template(messages, tokenize=False, **kw)
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    out.append((text, [int(i) for i in ids]))
  return {"json": np.array(json.dumps(out))}


def _serve() -> None:
  """Answers requests until stdin closes. What the libraries print goes to stderr: the
  answers have stdout to themselves."""
  import traceback  # pylint: disable=g-import-not-at-top

  answers = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  ops = {"logits": _logits, "generate": _generate, "save_random": _save_random}
  ops.update(encode=_encode, chat=_chat, moe_block=_moe_block)
  for line in sys.stdin:
    asked = json.loads(line)
    try:
      np.savez(asked["out"], **ops[asked["request"]["op"]](asked["request"]))
      error = None
    except Exception:  # pylint: disable=broad-except
      error = traceback.format_exc()
    answers.write(json.dumps({"error": error}) + "\n")
    answers.flush()


if __name__ == "__main__":
  _serve()
