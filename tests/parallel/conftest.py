"""``tests/parallel``: tests marked ``slow`` (several compiled models per spawned rank) run only when
the ``-m`` expression names them (``pytest -m slow tests/parallel``), so the folder's default run
stays within its time budget on a 2-core CPU."""

import pytest


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords and item.fspath is not None and "tests/parallel" in str(item.fspath):
            item.add_marker(skip)
