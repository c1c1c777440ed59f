"""Privacy reports and their figures.

* :mod:`dpfy.report.statement` — :class:`PrivacyReport` and :func:`build_report`: the statement
  accounted from a ledger (Ponomareva et al. 2023, Sec. 5.3.3);
* :mod:`dpfy.report.markdown` — the report rendered as ``report.md``;
* :mod:`dpfy.report.write` — :func:`write_report`: ``report.md``, ``report.json`` and figures;
* :mod:`dpfy.report.plots` — figures of a training run (epsilon over training, vs delta, by
  method); :mod:`dpfy.report.plots_tan` — TAN figures (Sander et al. 2023) and plan options.

Matplotlib is imported only when a figure is drawn.
"""

from dpfy.report.statement import PrivacyReport, build_report
from dpfy.report.write import write_report

__all__ = [
    "PrivacyReport",
    "build_report",
    "write_report",
]
