#!/usr/bin/env python3
"""Tokenizer and chat-template fixtures for the `mt-data` crate's tests.

Run (from the repository root; versions pinned in scripts/requirements-golden.txt):

    /opt/golden-venv/bin/python scripts/make_data_fixtures.py [--out DIR]

DIR defaults to crates/data/fixtures. The script is deterministic (the BPE trainer runs
on one thread and the corpus is fixed) and writes:

  tiny_tok/tokenizer.json, tiny_tok/tokenizer_config.json
      A byte-level BPE (vocab 320) trained with the `tokenizers` library on the original text
      below, special tokens <|endoftext|> (id 0), <|im_start|> (1), <|im_end|> (2). Like
      SmolLM2: a TemplateProcessing post-processor that adds nothing (no BOS), eos_token
      <|im_end|>, and SmolLM2's ChatML chat template in tokenizer_config.json.
  tiny_tok_bos/tokenizer.json, tiny_tok_bos/tokenizer_config.json, tiny_tok_bos/chat_template.jinja
      The same model with a post-processor that prepends <|endoftext|> as BOS; eos_token in the
      {"content": ...} object form; a Llama-2-like [INST] template that starts with
      {{ bos_token }} and calls raise_exception(), saved as chat_template.jinja (which wins over
      the dummy "chat_template" left in tokenizer_config.json, as in transformers 5).
  expected.json
      Oracle outputs: for each text, `tokenizers.Tokenizer.encode(text).ids` of both tokenizers;
      for each conversation and tokenizer, transformers'
      `AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=False)` (and
      with add_generation_prompt=True), the ids of that rendering (add_special_tokens=False),
      and the assistant mask: for each token, whether its character offset starts inside an
      assistant span, the span of assistant message i being the characters between
      render(messages[:i], add_generation_prompt=True) and render(messages[:i+1]).
"""

import argparse
import json
import os

# One thread for the BPE trainer, before the library starts its pool.
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

CORPUS = """\
The lighthouse keeper counted the waves each morning before the kettle boiled. Seven long
swells, then a short one, then seven again: the sea kept its own arithmetic, and he wrote it
down in a ledger that nobody else would ever read.

In the valley below, the orchard grew apples that tasted faintly of smoke. The farmers said
it came from the old charcoal pits under the roots; the children said it came from dragons.
Both answers were repeated so often that they became true in the telling.

A small train crossed the bridge at noon and again at dusk. Its driver waved to the keeper,
and the keeper waved back, although neither could see the other's face at that distance.
They had never spoken, yet each would have noticed at once if the other had stopped waving.

Numbers help: 3 apples, 12 waves, 2024 pages, 7 lanterns and 0 dragons (officially).
Questions help too. Where does the road go? Why does the bell ring twice on Sundays?
The answers are written nowhere, so the questions are asked again every year.

Unicode is welcome here: café, naïve, Ærøskøbing, 東京, Добрый день, and an emoji 🙂.
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

INST = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}\n"
)

TEXTS = [
    "The keeper counted the waves.",
    "  leading spaces, trailing newline\n",
    "café naïve Ærøskøbing 東京 🙂 Добрый",
    "digits 0123456789 and <|im_end|> inside text",
    "",
]

CONVERSATIONS = [
    [
        {"role": "user", "content": "How many waves?"},
        {"role": "assistant", "content": "Seven long, then one short."},
        {"role": "user", "content": "And the apples?"},
        {"role": "assistant", "content": "They taste of smoke, café-style 🙂"},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Where does the road go?"},
        {"role": "assistant", "content": "  Nowhere written down.  "},
    ],
]


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


def save(tok, out, name, config, template_file=None):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"), pretty=True)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    if template_file is not None:
        with open(os.path.join(d, "chat_template.jinja"), "w") as f:
            f.write(template_file)
    return d


def chat_oracle(d, tok):
    hf = AutoTokenizer.from_pretrained(d)
    # The transformers tokenizer must tokenise exactly like the raw tokenizers one.
    for text in TEXTS:
        assert hf(text)["input_ids"] == tok.encode(text).ids, (d, text)
    out = []
    for conv in CONVERSATIONS:
        try:
            rendered = hf.apply_chat_template(conv, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the Rust side must fail on the same input
            out.append({"messages": conv, "error": str(e)})
            continue
        with_prompt = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        enc = tok.encode(rendered, add_special_tokens=False)
        spans = []
        for i, m in enumerate(conv):
            if m["role"] != "assistant":
                continue
            before = hf.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True) if i else ""
            upto = hf.apply_chat_template(conv[: i + 1], tokenize=False)
            assert rendered.startswith(before) and rendered.startswith(upto)
            spans.append([len(before), len(upto)])
        mask = [any(a <= s < b for a, b in spans) for (s, _) in enc.offsets]
        out.append(
            {
                "messages": conv,
                "rendered": rendered,
                "rendered_with_generation_prompt": with_prompt,
                "ids": enc.ids,
                "assistant_char_spans": spans,
                "assistant_mask": mask,
            }
        )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="crates/data/fixtures")
    args = ap.parse_args()

    tok = train_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    plain_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "model_max_length": 8192,
        "chat_template": CHATML,
    }
    plain_dir = save(tok, args.out, "tiny_tok", plain_cfg)

    bos = Tokenizer.from_str(tok.to_str())
    bos.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A",
        pair="<|endoftext|> $A $B:1",
        special_tokens=[("<|endoftext|>", bos.token_to_id("<|endoftext|>"))],
    )
    bos_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True, "__type": "AddedToken"},
        "eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True, "__type": "AddedToken"},
        "chat_template": "this dummy template must lose against chat_template.jinja",
    }
    bos_dir = save(bos, args.out, "tiny_tok_bos", bos_cfg, template_file=INST)

    expected = {
        "vocab_size": tok.get_vocab_size(),
        "specials": {s: tok.token_to_id(s) for s in SPECIALS},
        "texts": [
            {"text": t, "ids": tok.encode(t).ids, "ids_bos": bos.encode(t).ids} for t in TEXTS
        ],
        "chat": chat_oracle(plain_dir, tok),
        "chat_bos": chat_oracle(bos_dir, bos),
    }
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
