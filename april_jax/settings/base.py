"""Every config field april_jax reads, with defaults. Files in configs/ start from here.

Configs are Python (ml_collections): `configs/<name>.py` defines `get_config(arg)`,
starting from `base.get_config()` and changing what it needs; any field can be
overridden on the command line, e.g. `--config.rollout.over_sampling_batch_size=64`.
`april_jax.settings.validate` checks the whole config once at start-up, before anything
compiles, and names the field at fault.
"""

import importlib.util
from pathlib import Path

import ml_collections
from ml_collections import config_dict

from april_jax import sharding


def sibling(config_file: str, name: str):
  """The config module `name` (e.g. "tiny.py") beside `config_file` (a config's own
  __file__), loaded by path: configs/ is a folder of files, not a package."""
  path = Path(config_file).resolve().parent / name
  spec = importlib.util.spec_from_file_location(f"april_jax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def no_variants(arg, path: str) -> None:
  """Refuses a variant (`--config=<path>:<arg>`) for a config file that has none."""
  if arg:
    raise ValueError(f"{path} has no variants (got {arg!r}); use it without ':{arg}'")


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # params init, data order, sampling keys: a run is reproducible for a seed
  c.num_steps = 100  # RL steps (updates); may change on resume
  c.checkpoint_every = 50  # steps; 0 = only at the end and on SIGTERM
  c.eval_every = 0  # steps; 0 = never
  c.log_every = 1  # steps between progress lines on the console
  # XLA's persistent compilation cache, so a resumed or repeated run does not compile every
  # program again. None: <workdir>/xla_cache; "" = off. JAX_COMPILATION_CACHE_DIR wins.
  c.compilation_cache_dir = config_dict.placeholder(str)
  c.model = _model()
  c.mesh = _mesh()
  c.distributed = _distributed()
  c.data = _data()
  c.rollout = _rollout()
  c.env = _env()
  c.train = _train()
  c.eval = _eval()
  return c


def qwen3_tool_turns(c: ml_collections.ConfigDict) -> None:
  """Sets c.env's turn fields for Qwen3's tool calls as a deployment serves them: a turn
  ends where a chat turn does (<|im_end|>), so every call of the turn is seen, and each
  tool result comes back as the chat template renders tool messages and the next
  generation prompt (envs/observation_format.py)."""
  c.env.turn_stop = ""
  c.env.observation_format = "chat_template"


def _model() -> ml_collections.ConfigDict:
  """The model: an HF folder or a random init, and its dtypes and attention."""
  m = ml_collections.ConfigDict()
  m.path = ""  # HF folder (config.json + safetensors); "" = random init
  m.tokenizer_path = ""  # default: model.path
  # Compute dtype: float32 | bfloat16 (master weights and AdamW moments are float32 always).
  m.dtype = "float32"
  m.kv_dtype = "float32"  # the sampler's KV cache: float32 | bfloat16
  m.remat = False  # rematerialise layers in the update
  m.attention = "auto"  # auto | dense | blockwise | cudnn (models/attention.py)
  m.attention_chunk = 512  # keys per block of blockwise attention
  i = m.init = ml_collections.ConfigDict()  # the shapes of a random init (no model.path)
  # Qwen3's shape, by config.json's names; 0 = unset (a random init needs them: tiny.py)
  i.vocab_size = i.hidden_size = i.intermediate_size = i.num_layers = 0  # Qwen3's shape
  i.num_heads = i.num_kv_heads = i.head_dim = 0  # Qwen3's shape
  # rope and norm as config.json's; std: the normal init's standard deviation
  i.rope_theta, i.rms_norm_eps, i.tie_word_embeddings, i.std = 1e6, 1e-6, True, 0.02
  return m


def _mesh() -> ml_collections.ConfigDict:
  """The device mesh and the learner's and the sampler's sharding rules."""
  m = ml_collections.ConfigDict()
  m.shape = (1, -1, 1)  # (data, fsdp, tensor); -1 takes the devices left
  m.rules = sharding.TRAIN_RULES  # the learner: FSDP x tensor
  m.decode_rules = sharding.DECODE_RULES  # the sampler: tensor parallel, slots over data
  # Rollout and learner on their own devices (docs/async.md): the last rollout_devices
  # devices decode (a mesh of rollout_shape), the rest learn (a mesh of `shape`), and the
  # two overlap. 0: colocated, one mesh taking turns.
  m.rollout_devices = 0
  m.rollout_shape = (-1, 1, 1)  # (data, fsdp, tensor) of the rollout mesh
  # Memory per device for the start-up plan; None = ask the device.
  m.device_memory_gb = config_dict.placeholder(float)
  return m


def _distributed() -> ml_collections.ConfigDict:
  """One process per host (april_jax/runtime/distributed.py)."""
  d = ml_collections.ConfigDict()
  d.auto = False  # jax.distributed from the cluster env (SLURM, Open MPI)
  d.coordinator_address = ""  # host:port of process 0; "" = one process (unless auto)
  d.num_processes = 1  # with coordinator_address: the run's processes
  d.process_id = 0  # this process's index, 0 .. num_processes - 1
  d.local_device_ids = ""  # "0,1,...,7": this process's GPUs ("" = JAX decides)
  d.heartbeat_timeout_s = 60  # a peer silent this long ends the run
  d.initialization_timeout_s = 300  # waiting for every process to join
  return d


def _data() -> ml_collections.ConfigDict:
  """The prompt source and its prompt format."""
  d = ml_collections.ConfigDict()
  d.source = "longtail"  # "longtail" (built-in task) or a .jsonl/.json/.parquet path
  d.prompt_key = ""  # "" = first of question/problem/prompt
  d.answer_key = ""  # "" = answer, or reward_model.ground_truth
  d.max_prompt_len = 512  # tokens; longer prompts are skipped and counted
  d.shuffle = True  # a seeded order, the same on every host
  d.system_prompt = ""  # a system message before each prompt's; "" = none
  d.enable_thinking = False  # Qwen3's chat template: thinking on
  d.task = ml_collections.ConfigDict()  # the built-in task (data.source = "longtail")
  d.task.ring_size = 64  # symbols on the ring; walks are at most this long
  d.task.median = 8.0  # answer lengths: log-normal with this median ...
  d.task.sigma = 0.9  # ... and this sigma of the log (the tail's weight)
  d.task.demo_overshoot = 0.0  # warm-start demonstrations that walk one symbol too far
  d.task.hide_target = False  # multi-turn: the target told only by env "lookup"
  return d


def _rollout() -> ml_collections.ConfigDict:
  """APRIL's rollout: batch, over-sampling, slots, sampling params, rewards."""
  r = ml_collections.ConfigDict()
  r.batch_size = 8  # N: prompt groups per training step
  r.n_samples_per_prompt = 4  # n
  r.over_sampling_batch_size = 16  # N' >= N: groups admitted per step
  r.partial_rollout = True  # False: the synchronous baseline
  r.resume_mode = "kv"  # kv | recompute
  r.max_staleness = config_dict.placeholder(int)  # policy versions; None = unlimited
  # Split meshes: False, each batch drawn by one version (reproducible); True, new weights
  # taken at the next decode call, live slots going on (docs/async.md).
  r.in_flight_updates = False
  r.num_slots = 32  # sequences the sampler decodes at once
  r.sync_every = 16  # decode steps per host round trip
  # The KV page pool: slots hold pages of page_size positions (a power of two) as their
  # sequences grow; decode attention reads the live pages, decode_block positions per
  # chunk. kv_pages unset: max_len for every slot (no preemption); fewer serve more slots
  # in the same memory and preempt the youngest slot when the pool runs out.
  r.page_size = 16
  r.kv_pages = config_dict.placeholder(int)  # pages in the pool (above)
  r.decode_block = 1024  # positions per chunk of decode attention (above)
  # xla: chunks of gathered pages (any backend); pallas: one kernel that reads each page in
  # place (GPUs, through Triton; a CPU interprets it, slowly); auto: pallas on NVIDIA GPUs,
  # xla elsewhere. The same attention either way.
  r.decode_attention = "auto"
  # Speculative decoding (docs/speculative.md): up to this many tokens a live slot is
  # guessed to draw next (n-gram matches in its own tokens and its group's) are checked
  # in one pass, each position drawn with its own key: the same tokens as plain decoding,
  # in fewer passes when guesses are right. 0 (off) to 32.
  r.speculative_tokens = 0
  r.speculative_ngram = 3  # the longest suffix of a slot's tokens a guess matches (1-8)
  # Each decode call speculates or not, whichever has drawn more tokens per second at
  # about as many live slots, measured as the run goes (needs speculative_tokens >= 1).
  r.speculative_auto = False
  # Past samples of each prompt the sampler keeps (host memory, 4,096 prompts at most) to
  # draft from: a group's samples finished in an earlier step, an earlier epoch's. 0: none.
  r.speculative_history = 0
  r.refill_batch = 1  # slots that finish before the host refills (when samples wait)
  r.prefill_width = 4  # prompts of one length bucket that start together share a prefill
  r.max_response_len = 256  # tokens a response may draw (a multi-turn one: with observations)
  r.temperature = 1.0  # sampling; the behaviour logprobs are under it
  r.top_p = 1.0  # nucleus; 1.0 = off
  r.top_k = 0  # 0 = off
  r.dynamic_sampling = False  # DAPO: drop groups whose rewards are equal
  r.max_dropped_groups = 64  # per step; past it they are kept, so every step ends
  r.reward = "math"  # a registered name, or path/to/file.py:fn or package.module:fn
  r.reward_url = ""  # an HTTP reward server: POSTs each sample, reads its score (wins over reward)
  r.reward_url_timeout_s = 10.0  # per request
  r.reward_url_retries = 2  # a failed request is tried again this many times, waits doubling
  r.reward_timeout_s = 10.0  # per sample; past it the worker is killed, the sample scored fallback
  r.reward_fallback = 0.0  # the reward of a sample whose reward or environment failed
  r.reward_workers = 2  # worker processes scoring at once
  # A run stops (exit 2, one line naming the cause) when every sample of this many steps
  # in a row failed the same way (its reward or environment raised or ran past its
  # limit), and at once when the first step does; 0: never.
  r.max_failed_steps = 3
  return r


def _env() -> ml_collections.ConfigDict:
  """A multi-turn environment (envs/): each sample an episode of model turns and
  observations. Off when name is ""."""
  e = ml_collections.ConfigDict()
  e.name = ""  # a registered env ("calculator"), or path/to/env.py:Name or package.module:Name
  e.turn_stop = (
      ""  # also ends a turn, besides the end of a chat turn: one token, e.g. "</tool_call>"
  )
  e.max_turns = 8  # model turns per episode
  e.max_observation_tokens = 256  # each longer tool result is cut to this (counted)
  e.timeout_s = 10.0  # per call of the environment; past it the episode ends (counted)
  e.workers = 4  # environment calls made at once (a user's environment: worker processes)
  # How the tools that run model-written code (python_tool) isolate it: "kernel" (a
  # sandbox of Linux namespaces and a seccomp filter; the run refuses to start where the
  # kernel does not allow one) or "none" (the audit hook and rlimits only, which are not a
  # barrier: a warning at start-up and in the run's summary). docs/environments.md.
  e.isolation = "kernel"
  # Calls run while the other slots decode, each answered at the first decode boundary
  # after it returns; False: every call is waited for right after the decode call that
  # ended its turn (the engine idles on calls, but a run is reproducible whatever their
  # timing).
  e.overlap = True
  # How an environment's answer is written after a turn: "chat_template" (tool messages
  # and the next generation prompt as the tokenizer's chat template renders them, thinking
  # as data.enable_thinking says) or "text" (the two fields below, for a tokenizer
  # without a chat template).
  e.observation_format = "text"
  # "text": the observation in this template, after close_turn when the turn ended on
  # turn_stop rather than on the end of a chat turn.
  e.observation_template = "{observation}"
  e.close_turn = ""  # "text": before the template when the turn ended on turn_stop
  return e


def _train() -> ml_collections.ConfigDict:
  """The objective, the optimizer and how an RL step's batch is split."""
  t = ml_collections.ConfigDict()
  _objective(t)
  _stale_data_corrections(t)
  _optimizer_and_batch(t)
  t.lora = _lora()
  t.lora_path = ""  # a PEFT LoRA folder to start the adapters from (matching train.lora)
  return t


def _objective(t: ml_collections.ConfigDict) -> None:
  """train's advantage estimator, policy loss, clips and KL terms."""
  # grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline, or gae: PPO
  # with a learned critic (rl/critic.py, the knobs below)
  t.advantage = "grpo"
  t.critic_path = ""  # a Qwen3 folder to start the critic from; "" = the policy's weights
  t.critic_lr = 1e-5  # the critic's learning rate
  t.value_clip = 0.2  # around the values at the start of the update; 0 = no clip
  t.gae_gamma = 1.0  # GAE's discount
  t.gae_lambda = 1.0  # GAE's lambda
  t.gae_whiten = True  # advantages whitened over the batch's trained tokens
  # How REINFORCE++ and GAE whiten over tokens: bessel (verl's and slime's: the unbiased
  # variance, 1e-8 inside the root) | population ((x - mu) / (sigma + eps), the population
  # std, eps outside the root)
  t.whitening = "bessel"
  # ppo_clip | gspo | clip_cov | kl_cov | gmpo | cispo (docs/algorithms.md)
  t.policy_loss = "ppo_clip"
  # Unset (None): the policy loss's own clips and aggregation: PPO's 0.2 / eps_clip /
  # token_mean, GSPO's 3e-4 / 4e-4 / seq_mean_token_mean, GMPO's 0.4 / 0.4 (on the
  # log-ratio) / seq_mean_token_mean, CISPO's 1.0 / 0.2 (no lower bound).
  t.eps_clip = config_dict.placeholder(float)
  t.eps_clip_high = config_dict.placeholder(float)  # DAPO's clip-higher: 0.28
  # None = off (slime's default); 3.0 is verl's (always on there). ppo_clip and clip_cov.
  t.dual_clip_c = config_dict.placeholder(float)
  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
  # (Dr. GRPO as its paper: / (sequences x norm_len)) | token_sum_norm (verl's
  # seq-mean-token-sum-norm: / norm_len)
  t.aggregation = config_dict.placeholder(str)
  t.norm_len = config_dict.placeholder(int)  # Dr.GRPO's constant normaliser (tokens)
  # clip_cov / kl_cov (arXiv 2505.22617): the fraction of the step's trained tokens
  # selected by the covariance of advantage and logprob (at least one)
  t.cov_ratio = 2e-4
  t.clip_cov_lb = 1.0  # clip_cov picks among covariances in (clip_cov_lb, clip_cov_ub)
  t.clip_cov_ub = 5.0  # (above)
  t.kl_cov_coef = 0.1  # kl_cov: the coefficient of |log ratio| on the selected tokens
  t.kl_coef = 0.0  # the KL loss term; 0 (and reward_kl_coef 0): no reference params held
  # REINFORCE++'s KL in the reward (advantage reinforce_plus_plus only): each drawn token's
  # reward -reward_kl_coef * (logp - ref_logp); 0 = off
  t.reward_kl_coef = 0.0
  t.kl_type = "low_var_kl"  # k1 | k2 | k3 (= low_var_kl, clamped) | low_var_kl | abs
  t.entropy_coef = 0.0  # an entropy bonus in the loss; 0 = off


def _stale_data_corrections(t: ml_collections.ConfigDict) -> None:
  """train's weights and masks for tokens drawn by older policy versions."""
  # Stale-data corrections (rl/corrections.py). Each token's term is weighted by
  # w = pi_prox / pi_behav (the learner's logprob at the start of the update over the
  # sampler's), at is_level token | sequence | geometric; is_mode truncate: min(w, tis_cap)
  # (TIS); mask: w inside [is_low, tis_cap], outside the token or sample leaves the loss
  # (IcePop: token, 0.5, 5; MIS: sequence or geometric). tis_cap 0 = no weight.
  t.tis_cap = 2.0
  t.is_level = "token"  # token | sequence | geometric (above)
  t.is_mode = "truncate"  # truncate | mask (above)
  t.is_low = 0.0  # mask's lower bound (above)
  # The ratio's anchor: proximal (the params at the start of the update; with a weight
  # this is decoupled PPO) | behavior (the sampler's logprobs: coupled PPO, no old-logprob
  # pass, tis_cap must be 0).
  t.ratio_anchor = "proximal"
  # Tokens drawn by an older policy version leave the loss (slime's
  # --mask-offpolicy-in-partial-rollout: the tokens a partial sample drew before it was cut).
  t.mask_stale_tokens = False


def _optimizer_and_batch(t: ml_collections.ConfigDict) -> None:
  """train's overlong penalty, optimizer, batch split and warm start."""
  t.overlong_buffer_len = config_dict.placeholder(int)  # DAPO's, in tokens; None = off
  t.overlong_penalty_factor = 1.0  # the overlong penalty at the budget's end
  t.lr = 1e-6  # AdamW's peak learning rate
  t.lr_schedule = "constant"  # constant | cosine
  t.warmup_steps = 0  # linear warm-up, in updates
  t.min_lr_ratio = 0.1  # cosine: the last learning rate / lr
  t.weight_decay = 0.0  # AdamW's
  t.b1 = 0.9  # AdamW's
  t.b2 = 0.999  # AdamW's
  t.max_grad_norm = 1.0  # gradients clipped to this global norm
  t.num_minibatches = 1  # optimizer updates per RL step (per epoch)
  t.num_microbatches = 1  # gradient accumulation per update
  # Samples packed end to end into rows of pack_len tokens (rl/layout.py): a microbatch is
  # B / (num_minibatches x num_microbatches) such rows, as many microbatches as the tokens
  # need; each sample attends to itself only. pack_len 0: data.max_prompt_len +
  # rollout.max_response_len. Off: a row per sample, padded.
  t.packing = True
  t.pack_len = 0  # tokens a packed row holds (above)
  # Unpacked: rows sorted by length, each microbatch cut to its own padded length.
  t.microbatch_by_length = True
  t.ppo_epochs = 1  # passes over the batch per step
  t.logprob_chunk = 512  # sequence chunk for logits (memory bound)
  t.warm_up = False  # compile the update for every length bucket ahead of time
  t.sft_steps = 0  # supervised warm-start steps (built-in task)
  t.sft_lr = 1e-3  # the warm start's learning rate
  t.sft_batch_size = 32  # the warm start's demonstrations per step


def _lora() -> ml_collections.ConfigDict:
  """train.lora: LoRA adapters instead of a full fine-tune."""
  t = ml_collections.ConfigDict()
  # LoRA (models/lora.py): adapters of this rank are trained (float32, AdamW) and the base
  # model stays frozen in model.dtype; 0 = no LoRA, every weight trains
  t.rank = 0
  t.alpha = 32.0  # the update is (alpha / rank) B A
  t.targets = "q,k,v,o,gate,up,down"  # the adapted projections, comma-separated
  t.lr = 1e-5  # the adapters' AdamW learning rate (train.lr is the full fine-tune's)
  # How the sampler decodes: merged (a copy of the base with the adapters merged in, made
  # once per update) | unmerged (the base itself, the adapters applied in every decode
  # step: no second copy of the base, room for more KV; one device only)
  t.decode = "merged"
  return t


def _eval() -> ml_collections.ConfigDict:
  """Evaluation: pass@1 and avg@k on held-out prompts."""
  e = ml_collections.ConfigDict()
  e.path = ""  # "" = held-out built-in task prompts
  e.num_prompts = 32  # held-out prompts evaluated
  e.k = 4  # avg@k samples per prompt; 0 = greedy only
  e.temperature = 0.6  # of the avg@k samples (pass@1 is greedy)
  e.top_p = 1.0  # nucleus of the avg@k samples
  e.before_training = True  # also evaluate before step 1 (the line of step 0)
  return e
