#!/usr/bin/env python3
"""Makes the small random-weight models the real-engine tests serve, deterministically and
offline (no model hub): a byte-level BPE tokenizer trained on the repository's LICENSE text,
and Llama models with fixed-seed random weights, saved as Hugging Face model directories.

    python scripts/make-models.py OUT_DIR [--name tiny|small|all]

Run it with an engine environment's Python (scripts/engines.sh): it needs ``torch``,
``transformers`` and ``tokenizers``. The same inputs give byte-identical tokenizer files and
the same weights on every run, so tests and benchmarks on different machines serve the same
model. Models:

- ``tiny``: 4 layers, hidden 256, 4 heads (2 KV heads), vocab 4,096: loads in seconds; what the
  tests use.
- ``small``: 8 layers, hidden 1,024, 16 heads (4 KV heads): about 98M parameters, prefill times
  of a few hundred milliseconds on 2 cores; what the engine benchmarks use.

A directory whose ``kvpool-model.json`` names the same recipe is left as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

RECIPE_VERSION = 1
VOCAB = 4096
MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus(root: pathlib.Path) -> list[str]:
    """The training text: the repository's LICENSE (a text that does not change), so the
    tokenizer is the same whatever else the repository's files say."""
    return [(root / "LICENSE").read_text(encoding="utf-8")]


def make_tokenizer(out: pathlib.Path, root: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(root), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n")


def make_model(out: pathlib.Path, name: str, root: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    recipe = {"recipe": RECIPE_VERSION, "name": name, **MODELS[name], "vocab_size": VOCAB}
    stamp = out / "kvpool-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        print(f"make-models: {out} is up to date")
        return
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, root)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    cfg = LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-5,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False, torch_dtype="bfloat16", **MODELS[name])
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg)
    # Larger than the default init so that greedy outputs depend on the whole prompt and
    # wrong KV (a block loaded from the wrong key) changes the output.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.06, generator=torch.Generator().manual_seed(p.numel()))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    stamp.write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    print(f"make-models: {name} in {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--name", default="tiny", choices=[*MODELS, "all"])
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    root = pathlib.Path(__file__).resolve().parent.parent
    for name in (MODELS if args.name == "all" else [args.name]):
        make_model(args.out / name, name, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
