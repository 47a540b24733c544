"""``python -m inductor_ext cp-check`` itself (:mod:`inductor_ext.report.cp_check`: the whole tiny
GLM-5.3 model under context parallelism against one rank, indexer selections pinned, derived
gradient bounds) on gloo processes: on 2 ranks for ``reference()`` and ``serving_aligned()`` in
both layouts, on 4 ranks for ``reference()`` (zigzag) and ``serving_aligned()`` (contiguous),
every row within its stated bound, and the same 4-rank runs with planted partial gradients, which
must fail exactly the planted rows. The model's own CP tests: ``tests/parallel/test_model_cp.py``."""

from __future__ import annotations

import pytest
import torch

from inductor_ext.parallel import LAYOUTS
from tests.support.parallel import job_result, register


def check_worker(rank: int, world: int, config_name: str, layout: str, plants: tuple = ()) -> dict:
    """``cp-check`` itself (:func:`inductor_ext.report.cp_check._compare`, T = 32·world): its rows,
    and with ``plants`` a second row set from the same runs with those partial gradients planted."""
    from inductor_ext.report.cp_check import _compare

    sets = ((),) + ((plants,) if plants else ())
    row_sets, meta = _compare(world, torch.device("cpu"), layout, config_name, 32 * world, sets)
    return {"rows": row_sets, "meta": meta}


# planted defects for the self-test: rank 0's partial of the ill-conditioned 3-number mHC gradient 10%
# off in both precisions (the FP32 row must reject it; in BF16 it is below the rounding noise of
# that ill-conditioned sum, so the BF16 row passes), and rank 0's partial of the first DSA layer's
# kv_b_proj gradient doubled in the BF16 run only (a double count: the BF16 row must reject it)
PLANTS = (("layers.1.attn_hc.scale", 0, 1.1, "both"), ("layers.1.self_attn.kv_b_proj.weight", 0, 2.0, "bf16"))
PLANT_REJECTS = {"grad fp32 layers.1.attn_hc.scale", "grad layers.1.self_attn.kv_b_proj.weight"}
CHECK_CASES = (("reference", "zigzag"), ("serving_aligned", "contiguous"))
for _c, _lay in CHECK_CASES:
    register(4, f"cp-check-{_c}-{_lay}", check_worker, _c, _lay, PLANTS if _c == "reference" else ())
TWO_RANK_CHECKS = [(c, lay) for c in ("reference", "serving_aligned") for lay in LAYOUTS]
for _c, _lay in TWO_RANK_CHECKS:
    register(2, f"cp-check-{_c}-{_lay}", check_worker, _c, _lay)


@pytest.mark.parametrize("config_name,layout", TWO_RANK_CHECKS, ids=[f"{c}-{lay}" for c, lay in TWO_RANK_CHECKS])
def test_cp_check_on_two_ranks(config_name, layout):
    """``cp-check --ranks 2`` on the whole tiny model: every row within its stated bound."""
    rows = job_result(2, f"cp-check-{config_name}-{layout}")[0]["rows"][0]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert any(r["name"].startswith("grad fp32 ") for r in rows)


@pytest.mark.parametrize("config_name,layout", CHECK_CASES, ids=[f"{c}-{lay}" for c, lay in CHECK_CASES])
def test_cp_check_on_four_ranks(config_name, layout):
    """``cp-check --ranks 4`` on the whole tiny model: every row within its tolerance (gradients
    with the indexer selections pinned, BF16 within 3·√2·noise + fp32_gap, FP32 within 1e-4), the
    model's own indexer flips no more rows than one rank's BF16 and FP32 runs differ in."""
    res = job_result(4, f"cp-check-{config_name}-{layout}")[0]
    rows = res["rows"][0]
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    names = {r["name"] for r in rows}
    assert "grad layers.1.attn_hc.scale" in names and "grad fp32 layers.1.attn_hc.scale" in names
    assert any(r["name"].startswith("model indexer ids") for r in rows)


def test_cp_check_rejects_planted_gradients():
    """The check can fail: the planted partials (PLANTS) fail exactly their rows, nothing else."""
    res = job_result(4, "cp-check-reference-zigzag")[0]
    planted = res["rows"][1]
    assert {r["name"] for r in planted if not r["ok"]} == PLANT_REJECTS, \
        [(r["name"], r["rel_l2"], r["tolerance"]) for r in planted if not r["ok"] or r["name"] in PLANT_REJECTS]
