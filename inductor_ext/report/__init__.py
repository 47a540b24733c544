"""The accuracy / compile / timing report (``python -m inductor_ext report``), the train/serve
mismatch-KL ablation (``python -m inductor_ext mismatch``) and the context-parallel check
(``python -m inductor_ext cp-check``): :mod:`~inductor_ext.report.report`,
:mod:`~inductor_ext.report.mismatch` and :mod:`~inductor_ext.report.cp_check`."""

from __future__ import annotations

from inductor_ext.report.mismatch import MismatchSettings, default_arms, format_table, run_mismatch, write_json
from inductor_ext.report.report import run_report

__all__ = ["MismatchSettings", "default_arms", "format_table", "run_mismatch", "run_report", "write_json"]
