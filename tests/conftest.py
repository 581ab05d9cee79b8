"""Shared fixtures: tiny demo checkpoints (target, draft, draft with a Markov head)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from specsplit.demo import make_demo_models


@dataclass
class DemoModels:
    target: Path
    draft: Path
    markov_draft: Path


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory: pytest.TempPathFactory) -> DemoModels:
    root = tmp_path_factory.mktemp("models")
    target, draft = make_demo_models(root, size="small")
    _, markov_draft = make_demo_models(root, markov_rank=8, size="small")
    return DemoModels(target, draft, markov_draft)


# `make test` runs the suite on 2 pytest-xdist workers with --dist loadgroup. A file is one group (its
# module-scoped services start once, on one worker) unless a test names its own group: a test that
# starts its own services and runs for minutes (e.g. the chi-square service test) then runs beside its
# file. The longest groups are handed out first, so that none of them starts last and runs alone.
LONGEST_FIRST = (
    "chi_square_service",
    "test_feature_draft.py",
    "chi_square_feature",
    "test_services_lossless.py",
    "test_rejection_sampled.py",
    "test_gguf.py",
    "test_gguf_qwen2.py",
    "test_sdk_unit.py",
    "test_services_faults.py",
    "test_load.py",
    "test_prometheus_live.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def group(item: pytest.Item) -> str:
        marker = item.get_closest_marker("xdist_group")
        if marker is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
            return item.path.name
        return str(marker.args[0] if marker.args else marker.kwargs["name"])

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: file order within a group
