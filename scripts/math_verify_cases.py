"""Extract Math-Verify's own test cases into tests/data/math_verify_cases.jsonl.

    python scripts/math_verify_cases.py PATH/TO/Math-Verify [--out tests/data/math_verify_cases.jsonl]

Math-Verify (github.com/huggingface/Math-Verify, MIT licence, (c) 2024 The HuggingFace Team)
tests its grader with (gold, pred, expected) cases in `pytest.mark.parametrize` lists. This reads
them as data (never imports or runs that code): every parametrized case of a test whose body
calls `compare_strings` (the suite's helper: parse both with the given extraction targets,
then verify) or `verify(parse(gold), parse(pred))`, with the settings that call passes
(match types, float precision, set-relation comparison). Commented-out cases are not cases.
tests/tasks/test_math_grader_cases.py grades each with emapg.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path

FILES = ["tests/test_all.py", "tests/test_boxed.py", "tests/test_numina_cases.py",
         "tests/test_open_thoughts.py", "tests/test_yujianll.py"]  # fmt: skip
SETTINGS = ("match_types", "precision", "strict", "allow_set_relation_comp")


def _grading_call(function: ast.FunctionDef) -> tuple[str, dict] | None:
    """("compare_strings", its keyword arguments as source) or ("verify", {}); None otherwise."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "compare_strings":
                return "compare_strings", {k.arg: ast.unparse(k.value) for k in node.keywords}
            if node.func.id == "verify":
                return "verify", {}
    return None


def cases_of(source: str, file: str) -> list[dict]:
    out = []
    for function in ast.parse(source).body:
        if not isinstance(function, ast.FunctionDef):
            continue
        call = _grading_call(function)
        for decorator in function.decorator_list:
            if not (
                isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.parametrize"
            ):
                continue
            names = [n.strip() for n in ast.literal_eval(decorator.args[0]).split(",")]
            if call is None or names[:2] != ["gold", "pred"]:
                continue
            helper, keywords = call
            for element in decorator.args[1].elts:
                try:
                    values = ast.literal_eval(element)
                except ValueError:  # built by code (an f-string): not data this reads
                    print(f"skipped {file}:{element.lineno}: not a literal")
                    continue
                row = dict(zip(names, values, strict=True))
                settings = {"match_types": ["latex", "expr"], "precision": 6, "strict": True,
                            "allow_set_relation_comp": False}  # fmt: skip
                for key in SETTINGS:
                    if key in keywords:  # a literal, or the name of a parameter of the case
                        text = keywords[key]
                        settings[key] = row[text] if text in row else ast.literal_eval(text)
                out.append({
                    "file": file, "test": function.name, "helper": helper, "gold": row["gold"],
                    "pred": row["pred"], "expected": int(row.get("expected", row.get("result"))), **settings,
                })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("repo", type=Path, help="a Math-Verify checkout, or its bare git directory")
    parser.add_argument("--out", type=Path, default=Path("tests/data/math_verify_cases.jsonl"))
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    cases = []
    for file in FILES:
        source = subprocess.run(["git", "-C", str(args.repo), "show", f"HEAD:{file}"], capture_output=True,
                                text=True, check=True).stdout  # fmt: skip
        cases += [{"commit": commit, **c} for c in cases_of(source, file)]
    args.out.write_text("".join(json.dumps(c) + "\n" for c in cases))
    print(f"{len(cases)} cases from Math-Verify {commit[:12]} -> {args.out}")


if __name__ == "__main__":
    main()
