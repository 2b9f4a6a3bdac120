"""The paper's recipes (configs/paper/): each file's header table maps every setting of the paper's
script to an emapg field; the config, loaded, holds exactly those values."""

import re

import pytest
import torch
import yaml

from emapg.training.config import CONFIG_DIR, load_config
from helpers import placeholders

PAPER = sorted((CONFIG_DIR / "paper").glob("*.yaml"))
ROW = re.compile(r"^# \|(?P<cells>.*)\|\s*$")


def mapped(path) -> list[tuple[str, str]]:
    """(emapg field, value) of every row of the header's first table that names a field."""
    rows, table = [], 0
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        m = ROW.match(line)
        if not m:
            table += bool(rows)  # a blank comment line ends the first table
            continue
        cells = [c.strip() for c in m.group("cells").split("|")]
        if table == 0 and len(cells) == 4 and "." in cells[2] and not cells[3].startswith("("):
            rows.append((cells[2], cells[3]))
    return rows


def test_there_are_the_papers_two_recipes():
    names = {p.stem for p in PAPER}
    assert names >= {
        "search_r1_qwen2.5_3b_base",
        "deepscaler_r1_distill_1.5b_8k",
        "deepscaler_r1_distill_1.5b_16k",
        "deepscaler_r1_distill_1.5b_24k",
    }


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_every_mapped_setting_holds_in_the_loaded_config(path, tmp_path):
    rows = mapped(path)
    assert len(rows) >= 25, f"{path.name}: the header table maps only {len(rows)} settings"
    cfg = load_config(f"paper/{path.stem}", placeholders(path, tmp_path))
    for field, value in rows:
        section, key = field.split(".")
        got = getattr(getattr(cfg, section), key)
        want = yaml.safe_load(value)
        assert got == (float(want) if isinstance(got, float) else want), f"{path.name}: {field}"


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_placeholders_stop_with_one_line_until_set(path):
    from emapg.errors import EmapgError

    with pytest.raises(EmapgError) as raised:
        load_config(f"paper/{path.stem}")
    assert "/path/to/" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("path", [p for p in PAPER if p.stem.startswith("deepscaler")], ids=lambda p: p.stem)
def test_deepscaler_k3_term_is_verls_without_the_importance_weight(path, tmp_path):
    """The paper's fork reads use_kl_iw with a default of false and its DeepScaleR scripts do not
    set it. One token, log pi -1, log pi_old -1.5, log ref -2: verl's k3 term e^-1 = 0.3679 with
    gradient 1 - e^-1 = 0.6321; with the weight e^0.5 it would be 0.6065 and 1.0422."""
    from emapg.algo import kl

    cfg = load_config(f"paper/{path.stem}", placeholders(path, tmp_path))
    logp = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
    ref, old = torch.tensor([-2.0], dtype=torch.float64), torch.tensor([-1.5], dtype=torch.float64)
    weight = kl.importance_weight(logp, old) if cfg.kl.importance_weight else None
    term = kl.from_logprobs(logp, ref, estimator=cfg.kl.estimator, weight=weight)
    (grad,) = torch.autograd.grad(term.sum(), logp)
    assert term.item() == pytest.approx(0.36788, abs=1e-5) and grad.item() == pytest.approx(0.63212, abs=1e-5)
