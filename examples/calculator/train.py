"""Train the built-in tiny model to use a calculator: python examples/calculator/train.py [key=value ...]"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # calculator.py, importable by the reward worker as well

from calculator import CalculatorTask  # noqa: E402

import emapg  # noqa: E402


def main(overrides: list[str]) -> dict:
    result = emapg.train(str(HERE / "config.yaml"), overrides, task=CalculatorTask())
    before, after = result["accuracy_before"], result["accuracy_after"]
    print(
        f"eval/accuracy {before:.1%} before training -> {after:.1%} after "
        f"({100 * (after - before):+.1f} points); run: {result['run_dir']}"
    )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
