"""Rebuild the shipped examples: the instruction data set and the tiny-llama tokenizer and config.

    .venv/bin/python examples/make_examples.py

Everything is made offline and deterministically, so the files in the repository
are exactly what this script writes. tiny-llama has no weights: train it with
method "scratch" (its config.json), or save a random one with
`AutoModelForCausalLM.from_config` for inference tests.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
TINY_LLAMA = HERE / "models" / "tiny-llama"

# Kept tiny on purpose: the tests train it on two CPU ranks in seconds.
TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_instructions(n: int = 240, seed: int = 7) -> list[dict[str, str]]:
    """Small instruction/input/output records a tiny model can partly learn."""
    rng = random.Random(seed)
    words = ["apple", "river", "stone", "candle", "winter", "garden", "mirror", "silver", "thunder", "lantern"]
    records: list[dict[str, str]] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            records.append({"instruction": "Add the two numbers.", "input": f"{a} {b}", "output": str(a + b)})
        elif kind == 1:
            w = rng.choice(words)
            records.append({"instruction": "Reverse the word.", "input": w, "output": w[::-1]})
        elif kind == 2:
            w = rng.choice(words)
            records.append({"instruction": "Write the word in capitals.", "input": w, "output": w.upper()})
        else:
            w = rng.choice(words)
            records.append({"instruction": "How many letters are in the word?", "input": w, "output": str(len(w))})
    return records


def make_chat(instructions: list[dict[str, str]]) -> list[dict[str, list[dict[str, str]]]]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"{r['instruction']}\n{r['input']}"},
                {"role": "assistant", "content": r["output"]},
            ]
        }
        for r in instructions
    ]


def write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def build_tokenizer(corpus: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_LLAMA_CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(TINY_LLAMA)
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[:3]}
    assert ids == {"<s>": 0, "</s>": 1, "<pad>": 2}, ids


def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    TINY_LLAMA.mkdir(parents=True, exist_ok=True)
    instructions = make_instructions()
    write_jsonl(DATA / "instructions.jsonl", instructions)
    write_jsonl(DATA / "chat.jsonl", make_chat(instructions))
    text = (DATA / "shakespeare.txt").read_text()
    corpus = [*text.split("\n\n"), *(json.dumps(r) for r in instructions)]
    build_tokenizer(corpus)
    (TINY_LLAMA / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=2) + "\n")


if __name__ == "__main__":
    main()
