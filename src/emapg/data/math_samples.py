"""The shipped math sample sets: generated arithmetic and algebra word problems with known
answers (math_*.jsonl), and two-digit sums (sums_*.jsonl, for the real model's config).

`python -m emapg.data.math_samples` rewrites both pairs of files beside this file (DeepScaleR
schema: problem, answer). Generation is a pure function of the seed; train and
eval never share a problem. Answers are short (integers, a few fractions) so that the built-in
tiny model can learn them; the text uses only characters its tokenizer knows.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ["Ana", "Ben", "Carla", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivan", "June", "Kofi", "Lena"]
ITEMS = ["apples", "books", "coins", "marbles", "pens", "stamps", "shells", "cards"]


def latex(value: Fraction) -> str:
    """An exact answer as a reference is written: "7", "-3", "\\frac{3}{4}", "-\\frac{1}{2}"."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _add(r: random.Random) -> tuple[str, Fraction]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 60), r.randint(2, 40)
    return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", Fraction(a + b)


def _subtract(r: random.Random) -> tuple[str, Fraction]:
    name, item, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 40)
    a = b + r.randint(1, 50)
    return f"{name} had {a} {item} and gave away {b}. How many {item} are left?", Fraction(a - b)


def _multiply(r: random.Random) -> tuple[str, Fraction]:
    item, a, b = r.choice(ITEMS), r.randint(2, 12), r.randint(2, 12)
    return f"There are {a} boxes with {b} {item} in each box. How many {item} are there in all?", Fraction(
        a * b
    )


def _share(r: random.Random) -> tuple[str, Fraction]:
    item, each, friends = r.choice(ITEMS), r.randint(2, 15), r.randint(2, 9)
    return (
        f"{each * friends} {item} are shared equally among {friends} friends. How many {item} does each friend get?",
        Fraction(each),
    )


def _percent(r: random.Random) -> tuple[str, Fraction]:
    percent, whole = r.choice([10, 20, 25, 50, 75]), r.randint(1, 50) * 20
    return f"What is {percent}% of {whole}?", Fraction(percent * whole, 100)


def _order_of_operations(r: random.Random) -> tuple[str, Fraction]:
    a, b, c = r.randint(1, 20), r.randint(2, 9), r.randint(2, 9)
    return f"What is {a} + {b} * {c}?", Fraction(a + b * c)


def _linear(r: random.Random) -> tuple[str, Fraction]:
    a, x, b = r.randint(2, 9), r.randint(-9, 12), r.randint(-20, 20)
    sign = "+" if b >= 0 else "-"
    return f"Solve for x: {a}x {sign} {abs(b)} = {a * x + b}.", Fraction(x)


def _fraction(r: random.Random) -> tuple[str, Fraction]:
    a, b = r.randint(2, 9), r.randint(-20, 20)
    while b == 0 or b % a == 0:  # a fraction answer, never an integer
        b = r.randint(-20, 20)
    return f"Solve for x: {a}x = {b}.", Fraction(b, a)


KINDS = [_add, _subtract, _multiply, _share, _percent, _order_of_operations, _linear, _fraction]


def generate(num_train: int, num_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct problems of every kind in turn; eval first, so its set never depends on num_train."""
    rng = random.Random(f"math-samples-{seed}")
    seen: set[str] = set()
    records: list[dict] = []
    while len(records) < num_train + num_eval:
        question, value = KINDS[len(records) % len(KINDS)](rng)
        if question not in seen:
            seen.add(question)
            records.append({"problem": question, "answer": latex(value)})
    return records[num_eval:], records[:num_eval]


def generate_sums(num_train: int, num_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Distinct two-digit sums "What is a + b?" (a and b from 10 to 99, 8,100 problems in all);
    eval first, as in `generate`. The set a 135M pretrained model learns on CPU: its greedy
    answers are wrong about four times in five, and a few SFT steps teach the boxed format."""
    rng = random.Random(f"sums-{seed}")
    seen: set[tuple[int, int]] = set()
    records: list[dict] = []
    while len(records) < num_train + num_eval:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a, b) not in seen:
            seen.add((a, b))
            records.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
    return records[num_eval:], records[:num_eval]


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


# What the shipped files were made with: file stem -> (generator, sizes)
SETS = {
    "math": (generate, {"num_train": 1000, "num_eval": 100, "seed": 0}),
    "sums": (generate_sums, {"num_train": 2000, "num_eval": 200, "seed": 0}),
}

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    for stem, (make, sizes) in SETS.items():
        train, eval = make(**sizes)
        write(here / f"{stem}_train.jsonl", train)
        write(here / f"{stem}_eval.jsonl", eval)
        print(f"wrote {len(train)} + {len(eval)} {stem} problems to {here}")
