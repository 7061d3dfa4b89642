"""Checkpoints shared by the engine tests: built by HF once per module, saved, loaded by ours."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from engine_adapter.model import DeepseekForCausalLM
from tests.engine_adapter.hf_oracle import build_hf


class Pair(NamedTuple):
    hf: object  # the HF model (oracle)
    ours: DeepseekForCausalLM  # ours, loaded from the HF checkpoint
    directory: object  # the checkpoint directory


def make_pair(tmp_path_factory, name: str, **hf_fields) -> Pair:
    hf = build_hf(**hf_fields)
    directory = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory)
    return Pair(hf, DeepseekForCausalLM.from_pretrained(directory, dtype=torch.float32), directory)


@pytest.fixture(scope="session")
def v3(tmp_path_factory) -> Pair:
    return make_pair(tmp_path_factory, "v3")


@pytest.fixture(scope="session")
def v32(tmp_path_factory) -> Pair:
    return make_pair(tmp_path_factory, "v32", v32=True)
