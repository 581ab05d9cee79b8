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
