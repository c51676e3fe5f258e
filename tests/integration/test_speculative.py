"""Speculative decoding through every layer: `tokenfleet up --speculative-config` puts it in the model's
registry record, the worker speculates, the real `openai` client gets the same greedy text (fp32) with and
without it (``speculative: false`` opts a request out), and the worker's load report counts what happened."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import load_report
from tokenfleet.cli import launcher

CODE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height


def perimeter(width, height):
    """Perimeter of a rectangle."""
    return 2 * (width + height)
'''


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    c = launcher.up(1, str(default_model_dir), "smol", 1, 0, dtype="float32", record=False,
                    speculative_config='{"decoding_type": "NGram", "max_draft_len": 5, "adaptive": false}')
    yield c
    c.stop()


def test_speculation_is_lossless_through_the_gateway_and_can_be_refused(cluster):
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Rename width to w and return the whole file:\n\n" + CODE}]
    worker = cluster.addresses["worker-0"]

    def ask(**extra) -> str:
        stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=48, temperature=0,
                                                stream=True, **extra)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    spoken = ask()
    report = load_report(worker)
    assert report.num_spec_verifications > 0 and report.num_spec_proposed_tokens >= report.num_spec_accepted_tokens > 0
    plain = ask(extra_body={"speculative": False})
    assert plain == spoken and plain
    assert load_report(worker).num_spec_verifications == report.num_spec_verifications  # the opted-out one did not
    with pytest.raises(openai.BadRequestError):
        ask(extra_body={"speculative": "sometimes"})
