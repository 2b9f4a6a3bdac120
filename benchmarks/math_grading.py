"""Cost of one emapg.tasks.math.score call, on typical responses and on adversarial ones.

Typical: a short chain of reasoning ending in a boxed integer, fraction or expression, half of
them right; every response is distinct (math-verify caches parses, a real run rarely repeats a
response), references repeat as in GRPO groups. Adversarial: the worst of the inputs that
tests/tasks/test_math_grader.py builds to hang or crash a grader, each also from a worker thread,
where math-verify's signal timeouts cannot work (as in a reward function called from a thread
pool): the grader's own time limit (TIME_LIMIT_S) and guards must bound it there too.

    python benchmarks/math_grading.py [--n 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from emapg.tasks.math_grader import score


def typical(n: int, kind: str, rng: random.Random) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        right = i % 2 == 0
        if kind == "integer":
            answer, reference = str(a + b if right else a + b + 1), str(a + b)
        elif kind == "fraction":
            answer, reference = (f"\\frac{{{a}}}{{{b}}}" if right else f"\\frac{{{b}}}{{{a}}}"), f"{a}/{b}"
        else:
            answer, reference = (f"{a}x^2 + {b}x" if right else f"{a}x^2 - {b}x"), f"x({a}x + {b})"
        text = f"Step {i}: we combine {a} and {b} as shown above.\nTherefore the answer is $\\boxed{{{answer}}}$."
        out.append((text, reference))
    return out


ADVERSARIAL = {
    "2^{10^{100}}": ("\\boxed{2^{10^{100}}}", "2"),
    "(10^7)!": ("\\boxed{(10^{7})!}", "5"),
    "3000 nested braces": ("\\boxed{" + "{" * 3000 + "5" + "}" * 3000 + "}", "5"),
    "100 kB of garbage": ("".join(random.Random(0).choice("{}^\\boxed 0123") for _ in range(100_000)), "5"),
    "braces 19 deep": ("\\boxed{" + "{" * 19 + "1" + "}" * 19 + "}", "1"),
    "(a+b+c+d)^{60}": ("\\boxed{(a+b+c+d)^{60}}", "1"),
    "a 100-element tuple": ("\\boxed{(" + ", ".join(f"x_{{{i}}}" for i in range(100)) + ")}", "1"),
}


def per_call_ms(pairs: list[tuple[str, str]]) -> tuple[float, float]:
    times = []
    for response, reference in pairs:
        t = time.perf_counter()
        score(response, reference)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.mean(times), max(times)


def in_worker_thread_ms(pair: tuple[str, str]) -> float:
    thread = threading.Thread(target=per_call_ms, args=([pair],))
    t = time.perf_counter()
    thread.start()
    thread.join()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=300, help="typical responses per kind")
    args = parser.parse_args()
    score("\\boxed{1}", "1")  # imports and first-call set-up are not part of a call's cost
    rng = random.Random(0)
    print("| input | mean ms / call | max ms | first call, in a worker thread, ms |\n|---|---|---|---|")
    for kind in ("integer", "fraction", "expression"):
        mean, worst = per_call_ms(typical(args.n, kind, rng))
        print(f"| typical, {kind} answer | {mean:.2f} | {worst:.1f} | |")
    for name, pair in ADVERSARIAL.items():
        in_thread = in_worker_thread_ms(pair)  # first: math-verify caches what it parsed
        mean, _ = per_call_ms([pair])
        print(f"| adversarial: {name} | {mean:.1f} | | {in_thread:.1f} |")


if __name__ == "__main__":
    main()
