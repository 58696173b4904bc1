"""Tiny MoE models for the live-vLLM tests, built on this machine: nothing is downloaded.

Run with the python of ``deploy/vllm-cpu/env.sh`` (torch, transformers and tokenizers come with
vLLM): ``models.py OUT_DIR`` writes ``OUT_DIR/tiny-qwen3-moe`` and ``OUT_DIR/tiny-deepseek-v3``,
each a Hugging Face model directory vLLM serves: ``config.json``, ``model.safetensors`` (weights
from a fixed seed, bf16) and a byte-level BPE tokenizer trained here on a fixed corpus, with a
chat template. The same script gives the same files byte for byte.

- ``tiny-qwen3-moe`` (``Qwen3MoeForCausalLM``): 4 layers, 16 routed experts, top-2, GQA. Prefix
  caching works with it on CPU: the tests of cached tokens use it.
- ``tiny-deepseek-v3`` (``DeepseekV3ForCausalLM``): MLA, layer 0 dense and 1-3 MoE with 16 routed
  experts (top-2, noaux_tc sigmoid gate) and a shared one. vLLM's CPU MLA kernel takes only
  ``kv_lora_rank + qk_rope_head_dim == 576``, and MLA turns prefix caching off on CPU.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SEED = 2026
VOCAB = 512  # the tokenizer's size, special tokens included; the models' vocabulary
SPECIAL = ["<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# the words the tokenizer is trained on, in seeded sentences
_VOCABULARY = """
the a of to and in is that for on with as by it at from this be are or an which rack tray
cell GPU expert prefill decode cache token prompt NVLink domain rank balance handoff engine
request stream batch layer model router gateway kernel memory step load window placement
group block hash prefix session agent tool call result file code test function value error
return import class def if else while for in not None True False
"""

_COMMON = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "bos_token_id": None,
    "eos_token_id": 0,  # <|end|>
    "pad_token_id": 1,
}
CONFIGS: dict[str, dict[str, object]] = {
    "tiny-qwen3-moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "tiny-deepseek-v3": {
        **_COMMON,
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_key_value_heads": 4,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "num_nextn_predict_layers": 0,
        "rope_scaling": None,
    },
}


def corpus(lines: int = 4000) -> list[str]:
    """Text to train the tokenizer on: sentences of the field's words from a fixed seed."""
    rng = random.Random(SEED)
    words = _VOCABULARY.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        model_max_length=_COMMON["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: Path, name: str, fast: PreTrainedTokenizerFast) -> None:
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(**CONFIGS[name])
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)
    fast.save_pretrained(target)
    # vLLM reads the served dtype and token ids from config.json; keep ours as written above.
    written = json.loads((target / "config.json").read_text())
    written.update({k: v for k, v in CONFIGS[name].items() if k in _COMMON})
    (target / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def main() -> None:
    out = Path(sys.argv[1])
    fast = tokenizer()
    for name in CONFIGS:
        build(out, name, fast)
        print(f"{out / name}")


if __name__ == "__main__":
    main()
