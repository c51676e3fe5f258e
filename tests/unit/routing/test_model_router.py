"""The model router's pieces: features, the classifier, the policy's JSON, the agreement check."""

from __future__ import annotations

import json
import random

import pytest

from tokenfleet.routing.model_router import FEATURES, Classifier, RouteInput, RoutePolicy, answers_agree, features


def ask(text: str, **kw) -> RouteInput:
    return RouteInput([("user", text)], **kw)


def test_features_read_task_markers_tools_json_tier_and_size():
    f = features(ask("Write a Python function that reverses a string.", max_tokens=256))
    assert f["marker_code"] == 1 and f["marker_fact"] == 0 and f["log_max_tokens"] > 5
    f = features(RouteInput([("system", "Be brief."), ("user", "What is the capital of Peru?")], tools=True,
                            json_mode=True, tier="batch"))
    assert f["marker_fact"] == 1 and f["question"] == 1 and f["has_system"] == 1 and f["num_messages"] == 2
    assert f["tools"] == 1 and f["json_mode"] == 1 and f["tier_batch"] == 1 and f["tier_interactive"] == 0
    assert features(ask("What is 12 + 30?"))["digits"] > 0 and features(ask("What is 12 + 30?"))["marker_math"] == 1
    assert features(ask("Explain why ice floats."))["marker_explain"] == 1
    assert set(features(ask("hi"))) == set(FEATURES)
    assert features(ask("whoever"))["marker_fact"] == 0  # word markers match whole words


def test_classifier_learns_a_rule_it_can_see():
    rng = random.Random(1)
    kinds = ["What is the capital of {}?", "Explain why {} happens in detail.", "Write a Python function for {}."]
    rows, labels = [], []
    for i in range(120):
        k = rng.randrange(3)
        rows.append(features(ask(kinds[k].format(f"thing{i}"))))
        labels.append(k == 0)  # facts are easy
    clf = Classifier.train(rows, labels)
    fact = clf.probability(features(ask("What is the capital of Chile?")))
    code = clf.probability(features(ask("Write a Python function for sorting.")))
    assert fact > 0.8 and code < 0.2


def test_policy_chooses_by_threshold_and_round_trips():
    clf = Classifier({"bias_one": -3.0, "marker_fact": 6.0})
    policy = RoutePolicy("small@v1", "big@v1", clf, threshold=0.5)
    assert policy.choose(ask("What is the capital of Peru?"))[0] == "small@v1"
    target, p = policy.choose(ask("Explain thermodynamics."))
    assert target == "big@v1" and p < 0.1
    again = RoutePolicy.from_json(policy.to_json())
    assert again.choose(ask("What is the capital of Peru?")) == policy.choose(ask("What is the capital of Peru?"))
    assert RoutePolicy.from_json(json.loads(policy.to_json())).small == "small@v1"


@pytest.mark.parametrize("raw, needle", [
    ({"big": "b", "weights": {}}, "small"),
    ({"small": "s", "big": "b", "weights": {"nonsense": 1.0}}, "unknown features"),
    ({"small": "s", "big": "b", "weights": {"bias_one": "x"}}, "numbers"),
    ({"small": "s", "big": "b", "weights": {}, "threshold": 1.5}, "threshold"),
])
def test_bad_policies_are_refused(raw, needle):
    with pytest.raises(ValueError, match=needle):
        RoutePolicy.from_json(raw)


@pytest.mark.parametrize("small, big, agree", [
    ("The capital of Norway is Oslo.", "Oslo", True),
    ("20 + 22 = 42", "42", True),
    ("Honesty is the best policy.", "policy", True),
    ("The capital of Vietnam is Hoi An.", "Hanoi", False),
    ("Bonjour", "Hola", False),
    ("", "", True),
    ("", "Oslo", False),
    ("Vaccines train the immune system to recognise a germ", "Vaccines train the immune system to fight a germ", True),
    ("Vaccines train the immune system", "Because the sky scatters blue light", False),
])
def test_agreement_check(small, big, agree):
    assert answers_agree(small, big) is agree


def test_the_committed_policy_loads_and_routes():
    from pathlib import Path

    raw = (Path(__file__).parents[3] / "benchmarks" / "data" / "router_policy.json").read_text()
    policy = RoutePolicy.from_json(json.loads(raw))
    assert {policy.small, policy.big} == {"smollm2", "gemma3"}
    targets = {policy.choose(ask(text))[0] for text in ("What is the capital of Peru?", "Write a Python function "
                                                       "that parses JSON and explain every line of it in detail.")}
    assert targets <= {"smollm2", "gemma3"}
