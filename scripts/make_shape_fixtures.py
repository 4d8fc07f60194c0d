#!/usr/bin/env python3
"""Reference fixtures at shapes the public fixtures do not have, for the GPU path's generic kernels.

The team's fixture generator (../shared/tools/make_fixtures.py: transformers + PEFT checkpoints,
adapters and float64 references) is run with the model shapes below instead of its own:

  * qwen3moe: hidden 80 (one partial FP8 block, not a multiple of 32 or 64), head dim 80 (no
    tensor-core attention instance), expert intermediate 48, dense intermediate 144;
  * mixtral: hidden 208, head dim 40 (a multiple of 8, not 16), 4 query heads on 1 KV head, expert
    intermediate 144 (two FP8 blocks, the second partial);
  * deepseekv3: hidden 144, MLA with k != v the other way round from DeepSeek-V3 (nope 48 + rope 16
    = 64 < v 80), kv_lora_rank 48, q_lora_rank 80, expert intermediate 80, shared expert, groups.

Every size is a multiple of 16 (NVFP4's group: scripts/make_nvfp4_fixtures.py quantizes these
too). Needs torch, transformers >= 5 and peft >= 0.21 (the H200 machine has them):

  make_shape_fixtures.py PATH/TO/make_fixtures.py OUT          # bf16 + FP8 + adapters + references
  make_nvfp4_fixtures.py quantize OUT && make_nvfp4_fixtures.py references OUT
"""
import importlib.util
import sys


def shape_configs(_which):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
    return {
        "qwen3moe": Qwen3MoeConfig(vocab_size=272, hidden_size=80, intermediate_size=144,
            moe_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=80, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=512, rope_theta=1000000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.05),
        "mixtral": MixtralConfig(vocab_size=272, hidden_size=208, intermediate_size=144,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=40,
            num_local_experts=5, num_experts_per_tok=2, max_position_embeddings=512,
            rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            sliding_window=None, initializer_range=0.05),
        "deepseekv3": DeepseekV3Config(vocab_size=272, hidden_size=144, intermediate_size=176,
            moe_intermediate_size=80, num_hidden_layers=2, first_k_dense_replace=1,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=80, kv_lora_rank=48,
            qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=80, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_scaling=None, initializer_range=0.05),
    }


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    spec = importlib.util.spec_from_file_location("make_fixtures", sys.argv[1])
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.tiny_configs = shape_configs  # main() looks the shapes up here
    # The public adapter set (attention-only, full with per-expert twin, rsLoRA, rank patterns).
    sys.argv = [sys.argv[1], sys.argv[2], "--set", "public", "--seed", "4242"] + sys.argv[3:]
    gen.main()


if __name__ == "__main__":
    main()
