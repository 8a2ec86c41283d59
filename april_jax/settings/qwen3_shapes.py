"""The shapes of released Qwen3 models, dense and mixture-of-experts (their HF
config.json), by name.

Configs for real models set `model.init` from here, so that the planner and the compile
check know the shape without weights; a run still loads `model.path`, whose config.json
must agree (trainer.py checks).
"""

QWEN3_SHAPES = {
    "qwen3_0_6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3_1_7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3_4b": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3_8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "qwen3_30b_a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "qwen3_235b_a22b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        norm_topk_prob=True,
    ),
}
