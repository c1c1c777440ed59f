"""What a careless loop hands make_private and PrivateTrainer: a NaN or infinite learning rate in
the optimizer's param groups, a string clip norm, a seed where a Randomness goes, labels of the
wrong dtype or out of range, a model left in eval mode. Each is one line naming the parameter
and its range, raised before the ledger holds a line."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.ledger import Ledger
from dpfy.randomness import Randomness
from dpfy.sampling import PoissonSampler
from dpfy.training import PrivateOptions
from dpfy.training.trainer import PrivateTrainer, TrainerOptions

KW = dict(target_epsilon=4.0, delta=1e-5, epochs=2, clip_norm=1.0, expected_batch_size=12)
LOSS = nn.CrossEntropyLoss(reduction="none")


def _data(n: int = 48):
    x = torch.randn(n, 5, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _make_private(lr: float = 0.5, labels=None, model=None, ledger=None, **kw) -> Ledger:
    """make_private and one step of the user's loop; the ledger it wrote into."""
    x, y = _data()
    model = model or _model()
    ledger = Ledger() if ledger is None else ledger
    m, opt, criterion, loader = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr),
        TensorDataset(x, y if labels is None else labels),
        options=PrivateOptions(ledger=ledger), **{**KW, "randomness": Randomness(0), **kw},
    )
    for xb, yb in loader:
        opt.zero_grad()
        criterion(m(xb), yb).backward()
        opt.step()
        break
    return ledger


def _fit(lr: float = 0.5, labels=None, model=None, ledger=None, **kw):
    x, y = _data()
    model = model or _model()
    sampler = PoissonSampler(48, 0.25, randomness=Randomness(1))
    options = {"clip_norm": 1.0, "epochs": 1, "delta": 1e-5, "target_epsilon": 4.0,
               "randomness": Randomness(0), "ledger": ledger if ledger is not None else Ledger(),
               **kw}
    trainer = PrivateTrainer(model, torch.optim.SGD(model.parameters(), lr), LOSS, x,
                             y if labels is None else labels, sampler, TrainerOptions(**options))
    return trainer.fit(max_steps=1)


CASES = [  # (id, keyword arguments, error type, the start of the one-line message)
    ("lr_nan", {"lr": math.nan}, ValueError, "lr must be in [0.0, 1e+15]"),
    ("lr_inf", {"lr": math.inf}, ValueError, "lr must be in [0.0, 1e+15]"),
    ("clip_norm_text", {"clip_norm": "1"}, ValueError, "clip_norm must be in (0.0, inf)"),
    ("randomness_int", {"randomness": 0}, TypeError, "randomness must be None or a dpfy"),
    ("labels_float", {"labels": torch.rand(48)}, TypeError,
     "targets must be integer class indices in [0, 1]"),
    ("labels_out_of_range", {"labels": torch.full((48,), 5)}, ValueError,
     "targets must be in [0, 1]"),
]


@pytest.mark.parametrize("api", ["make_private", "PrivateTrainer"])
@pytest.mark.parametrize(("case", "kw", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_before_any_ledger_line(api, case, kw, error, message):
    ledger = Ledger()
    with pytest.raises(error) as info:
        (_make_private if api == "make_private" else _fit)(ledger=ledger, **kw)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text, text
    assert len(ledger) == 0  # refused before the first line


def test_make_private_labels_are_checked_before_the_first_line(monkeypatch):
    seen: list[int] = []
    original = Ledger.record_metadata

    def record(self, **info):
        seen.append(1)
        return original(self, **info)

    monkeypatch.setattr(Ledger, "record_metadata", record)
    with pytest.raises(ValueError, match=r"^targets must be in \[0, 1\]"):
        _make_private(labels=torch.full((48,), 7))
    assert not seen


def test_a_model_left_in_eval_mode_is_warned_about():
    for run in (_make_private, _fit):
        model = _model().eval()
        with pytest.warns(UserWarning, match="model is in eval mode"):
            run(model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # train mode: no such warning
        _fit(model=_model())


def test_good_labels_and_rates_still_train():
    result = _fit(labels=_data()[1])
    assert result.steps == 1 and len(result.ledger) > 0
    assert len(_make_private(lr=0.0)) > 0  # a zero rate is a valid (if useless) choice
