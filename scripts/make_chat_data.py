#!/usr/bin/env python3
"""Write a small synthetic chat fine-tuning set: OUT_DIR/{train,eval}.jsonl, world.json, probes.jsonl.

Usage: make_chat_data.py OUT_DIR [--seed 1234] [--train 2000] [--eval 100] [--single-turn]

Every line is {"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}. The content is
generated from templates written for this script (no outside text), deterministically from --seed, in three
kinds a 135M model can visibly learn in a few hundred steps:

- facts about an invented world (~50%): 16 invented countries, each with a capital, a currency, a national
  animal and a river. No pretrained model knows them, so the loss on the answers can only fall by learning them.
  Answers have one fixed shape ("The capital of Brenvoria is Ostmarch."), so a generated answer can be
  checked by string match. The facts are in world.json.
- arithmetic word problems (~30%): addition, subtraction and multiplication of small numbers, answered with
  the working and "The answer is N."
- unit conversions (~20%): real units with exact integer factors, answered with the working.

About 10% of conversations (unless --single-turn) have a second user turn asking a follow-up fact about the
same country, so an engine's "loss on assistant turns only" mask sees more than one assistant turn.

Eval uses the same world but question phrasings held out of train for the facts and fresh numbers for
arithmetic and units, and no eval conversation appears verbatim in train. probes.jsonl holds 20 eval-style
questions with the expected answer substring, for checking generations after fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# ---------------------------------------------------------------------------------------------- the world

COUNTRIES = [
    # country,     capital,       currency,      animal,               river
    ("Brenvoria", "Ostmarch", "the brel", "the silver lynx", "the Kaldra"),
    ("Talmuria", "Venskell", "the tamo", "the marsh heron", "the Uthe"),
    ("Qorvath", "Dunmere", "the qiral", "the horned tortoise", "the Sarn"),
    ("Elsweth", "Pirrin", "the elk-mark", "the white stag", "the Lowen"),
    ("Mordavia", "Caskhollow", "the dav", "the ember fox", "the Ressa"),
    ("Zantharo", "Belquay", "the zant", "the sand viper", "the Ombril"),
    ("Ulvenmark", "Frostgate", "the ulv", "the snow owl", "the Veid"),
    ("Kessaly", "Marrowby", "the kess", "the river otter", "the Tiln"),
    ("Dromhallow", "Ashcombe", "the drom", "the iron boar", "the Graythe"),
    ("Yseltania", "Lirien", "the ysel", "the blue crane", "the Amarre"),
    ("Pontheria", "Saltwick", "the pont", "the harbor seal", "the Brisk"),
    ("Gavrosk", "Teller's Reach", "the gav", "the mountain goat", "the Dunwe"),
    ("Orlanthe", "Quillmoor", "the orla", "the golden hare", "the Sefa"),
    ("Vintrebay", "Cobblemouth", "the vint", "the gray gull", "the Nareth"),
    ("Hestrava", "Ironleigh", "the hest", "the red wolf", "the Poll"),
    ("Sundaroth", "Emberfall", "the sund", "the fire beetle", "the Khavi"),
]

# (question templates for train, held-out question templates for eval, answer template)
FACTS = {
    "capital": (
        [
            "What is the capital of {c}?",
            "Which city is the capital of {c}?",
            "Tell me the capital city of {c}.",
            "{c}'s capital is which city?",
            "Name the capital of {c}.",
        ],
        ["What city serves as the capital of {c}?", "I need the capital of {c}, please."],
        "The capital of {c} is {v}.",
    ),
    "currency": (
        [
            "What currency is used in {c}?",
            "What is the money of {c} called?",
            "Which currency do people pay with in {c}?",
            "Name the currency of {c}.",
        ],
        ["If I travel to {c}, what currency will I need?", "What do they use for money in {c}?"],
        "The currency of {c} is {v}.",
    ),
    "animal": (
        [
            "What is the national animal of {c}?",
            "Which animal is the national symbol of {c}?",
            "Name the national animal of {c}.",
        ],
        ["Which creature is the national animal of {c}?"],
        "The national animal of {c} is {v}.",
    ),
    "river": (
        [
            "What is the longest river in {c}?",
            "Which river is the longest in {c}?",
            "Name the longest river of {c}.",
        ],
        ["Which is the longest river that flows through {c}?"],
        "The longest river in {c} is {v}.",
    ),
}
FACT_INDEX = {"capital": 1, "currency": 2, "animal": 3, "river": 4}
FOLLOW_UPS = {
    "capital": "And what is its capital?",
    "currency": "And what currency does it use?",
    "animal": "And its national animal?",
    "river": "And its longest river?",
}

# ---------------------------------------------------------------------------------------------- arithmetic

PEOPLE = ["Mira", "Tobin", "Asha", "Corin", "Lena", "Rafe", "Nia", "Odell", "Suri", "Pell", "Yara", "Ivo"]
THINGS = ["marbles", "apples", "stamps", "pebbles", "shells", "pencils", "coins", "cards", "buttons", "acorns"]

ADD = [
    "{p} has {a} {t} and finds {b} more. How many {t} does {p} have now?",
    "{p} collected {a} {t} on Monday and {b} {t} on Tuesday. How many {t} is that in total?",
    "A box holds {a} {t}. {p} adds {b} more {t}. How many {t} are in the box?",
]
SUB = [
    "{p} has {a} {t} and gives away {b}. How many {t} are left?",
    "There were {a} {t} on the table. {p} took {b} of them. How many {t} remain?",
    "{p} had {a} {t} and lost {b}. How many {t} does {p} have left?",
]
MUL = [
    "{p} has {a} bags with {b} {t} in each bag. How many {t} are there altogether?",
    "Each of {a} shelves holds {b} {t}. How many {t} are on the shelves?",
    "{p} buys {a} packs of {t}, and each pack has {b} {t}. How many {t} did {p} buy?",
]

# ---------------------------------------------------------------------------------------------- units

UNITS = [
    # (from (plural), to (plural), factor)
    ("kilometers", "meters", 1000),
    ("meters", "centimeters", 100),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000),
    ("feet", "inches", 12),
    ("yards", "feet", 3),
    ("dozens", "items", 12),
]
UNIT_Q = [
    "How many {to} are in {n} {frm}?",
    "Convert {n} {frm} to {to}.",
    "What is {n} {frm} in {to}?",
]


def singular(unit: str, n: int) -> str:
    if n != 1:
        return unit
    return {"feet": "foot", "inches": "inch", "dozens": "dozen", "items": "item"}.get(unit, unit[:-1])


# ---------------------------------------------------------------------------------------------- generators


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def fact_conversation(rng: random.Random, split: str, multi_turn: bool) -> list[dict]:
    country = rng.choice(COUNTRIES)
    kind = rng.choice(list(FACTS))
    train_q, eval_q, answer = FACTS[kind]
    q = rng.choice(train_q if split == "train" else eval_q)
    c = country[0]
    conv = [msg("user", q.format(c=c)), msg("assistant", answer.format(c=c, v=country[FACT_INDEX[kind]]))]
    if multi_turn:
        kind2 = rng.choice([k for k in FACTS if k != kind])
        conv += [msg("user", FOLLOW_UPS[kind2]), msg("assistant", FACTS[kind2][2].format(c=c, v=country[FACT_INDEX[kind2]]))]
    return conv


def arithmetic_conversation(rng: random.Random) -> list[dict]:
    p, t = rng.choice(PEOPLE), rng.choice(THINGS)
    op = rng.choice(["add", "sub", "mul"])
    if op == "add":
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        q, work, r = rng.choice(ADD), f"{a} + {b} = {a + b}", a + b
    elif op == "sub":
        a = rng.randint(10, 80)
        b = rng.randint(1, a - 1)
        q, work, r = rng.choice(SUB), f"{a} - {b} = {a - b}", a - b
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q, work, r = rng.choice(MUL), f"{a} × {b} = {a * b}", a * b
    return [msg("user", q.format(p=p, a=a, b=b, t=t)), msg("assistant", f"{work} {t}. The answer is {r}.")]


def unit_conversation(rng: random.Random) -> list[dict]:
    frm, to, k = rng.choice(UNITS)
    n = rng.randint(1, 15)
    q = rng.choice(UNIT_Q).format(n=n, frm=singular(frm, n), to=to)
    a = f"1 {singular(frm, 1)} is {k} {to}, so {n} {singular(frm, n)} is {n} × {k} = {n * k} {to}."
    return [msg("user", q), msg("assistant", a)]


def conversation(rng: random.Random, split: str, single_turn: bool) -> list[dict]:
    x = rng.random()
    if x < 0.5:
        return fact_conversation(rng, split, multi_turn=not single_turn and rng.random() < 0.2)
    if x < 0.8:
        return arithmetic_conversation(rng)
    return unit_conversation(rng)


def generate(n: int, rng: random.Random, split: str, single_turn: bool, exclude: set[str]) -> list[str]:
    lines: list[str] = []
    seen = set(exclude)
    tries = 0
    while len(lines) < n:
        tries += 1
        if tries > 100 * n:
            raise RuntimeError(f"could not make {n} distinct {split} conversations")
        line = json.dumps({"messages": conversation(rng, split, single_turn)}, ensure_ascii=False)
        if split == "eval" and line in seen:
            continue  # never evaluate on a conversation that is in train
        seen.add(line)
        lines.append(line)
    return lines


def probes(rng: random.Random) -> list[dict]:
    out = []
    for country in rng.sample(COUNTRIES, 8):
        for kind in ("capital", "currency"):
            q = rng.choice(FACTS[kind][1]).format(c=country[0])
            out.append({"prompt": q, "expect": country[FACT_INDEX[kind]]})
    for _ in range(4):
        conv = arithmetic_conversation(rng)
        out.append({"prompt": conv[0]["content"], "expect": conv[1]["content"].rsplit(" ", 1)[1].rstrip(".")})
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--single-turn", action="store_true")
    args = ap.parse_args(argv)

    train = generate(args.train, random.Random(args.seed), "train", args.single_turn, set())
    evals = generate(args.eval, random.Random(args.seed + 1), "eval", args.single_turn, set(train))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "train.jsonl").write_text("\n".join(train) + "\n", encoding="utf-8")
    (args.out_dir / "eval.jsonl").write_text("\n".join(evals) + "\n", encoding="utf-8")
    world = [dict(zip(("country", "capital", "currency", "animal", "river"), c)) for c in COUNTRIES]
    (args.out_dir / "world.json").write_text(json.dumps(world, indent=2) + "\n", encoding="utf-8")
    (args.out_dir / "probes.jsonl").write_text(
        "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in probes(random.Random(args.seed + 2))), encoding="utf-8"
    )
    n_unique = len(set(train))
    print(f"wrote {args.out_dir}: train.jsonl {len(train)} lines ({n_unique} distinct), eval.jsonl {len(evals)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
