"""Build a tiny Llama-architecture model and tokenizer locally.

There is no model hub on the machines this project targets, so the demo and
the tests make their own model: random weights, a byte-level BPE tokenizer
trained on a few sentences. The shape is the smallest one that vLLM's CPU
attention kernels accept (head_dim 64).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["build_tiny_model", "SAMPLE_TEXT"]

SAMPLE_TEXT = [
    "Speculative decoding drafts several tokens and lets the target model verify them.",
    "The scheduler counts draft tokens, accepted tokens and the acceptance per position.",
    "OpenTelemetry exports counters and histograms to any collector over OTLP.",
    "A draft that agrees with the target is accepted; the first rejection ends the prefix.",
    "the quick brown fox jumps over the lazy dog, the quick brown fox jumps again.",
    "one two three four five six seven eight nine ten one two three four five six.",
]

_VOCAB_SIZE = 512
_MARKER = "otel_specdec_tiny_model.json"


def _train_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SAMPLE_TEXT * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out_dir)


def _save_model(out_dir: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger logits spread make greedy output less repetitive, so that
        # ngram lookup sees both hits and misses.
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Llama model with ``seed``-dependent weights to ``out_dir``.

    Idempotent: a directory that already holds a model built with the same
    seed is reused.
    """
    path = Path(out_dir)
    marker = path / _MARKER
    if marker.exists() and json.loads(marker.read_text()).get("seed") == seed:
        return path
    path.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(path)
    _save_model(path, seed)
    marker.write_text(json.dumps({"seed": seed}))
    return path
