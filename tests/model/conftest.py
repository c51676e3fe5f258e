from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def fp32_core(default_model_dir):
    from tests.model.helpers import make_core

    return make_core(default_model_dir)
