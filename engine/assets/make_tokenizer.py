"""Train the bundled byte-level BPE tokenizer on engine/assets/corpus.txt.

Usage (from the repository root; rewrites engine/assets/tokenizer/):

    python engine/assets/make_tokenizer.py

The result is a GPT-2-style byte-level BPE with exactly VOCAB_SIZE entries: the 256 byte symbols, one special
token <|endoftext|> (used as EOS, BOS, PAD and UNK) and VOCAB_SIZE - 257 learned merges. Because every byte has a
token and the ByteLevel pre-tokenizer/decoder are used (no prefix space, no normalizer), any text round-trips:
tok.decode(tok.encode(text)) == text. Training is single-threaded-equivalent and deterministic: re-running it on
the same corpus with the same `tokenizers` version reproduces tokenizer.json byte for byte. The committed JSON
files, not this script, are what the engine loads.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ASSETS = pathlib.Path(__file__).resolve().parent
CORPUS = ASSETS / "corpus.txt"
OUT_DIR = ASSETS / "tokenizer"
VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
MODEL_MAX_LENGTH = 2048


def train_tokenizer(corpus: pathlib.Path = CORPUS, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE trained on `corpus` with exactly `vocab_size` tokens (special token included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(corpus)], trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, expected {vocab_size}; the corpus is too small")
    return tok


def save_hf(tok: Tokenizer, out_dir: pathlib.Path = OUT_DIR) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (Hugging Face layout)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": MODEL_MAX_LENGTH,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(eos_id): {
                "content": EOS,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main() -> None:
    tok = train_tokenizer()
    save_hf(tok)
    size = (OUT_DIR / "tokenizer.json").stat().st_size
    print(f"wrote {OUT_DIR} (vocab {tok.get_vocab_size()}, tokenizer.json {size} bytes)")


if __name__ == "__main__":
    main()
