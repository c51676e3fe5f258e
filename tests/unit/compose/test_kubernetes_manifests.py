"""deploy/kubernetes against Kubernetes' published schemas (kubernetes-validate, strict: unknown fields fail),
rendered by `kubectl kustomize` where kubectl is installed (else the files kustomization.yaml lists), and the
properties an operator relies on: probes, GPU requests, disruption budgets, drain on termination, scrape
annotations, and container args the services' own parsers accept."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"


def documents() -> list[dict]:
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(ROOT)], capture_output=True, text=True, timeout=120, check=True)
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    listed = yaml.safe_load((ROOT / "kustomization.yaml").read_text())["resources"]
    return [d for name in listed for d in yaml.safe_load_all((ROOT / name).read_text()) if d]


DOCS = documents()
WORKLOADS = [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]


def by(kind: str, name: str) -> dict:
    return next(d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name)


def test_every_document_is_valid_against_the_schemas():
    version = kubernetes_validate.latest_version()
    for doc in DOCS:
        kubernetes_validate.validate(doc, version, strict=True)
    broken = copy.deepcopy(by("Deployment", "gateway"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # a typo must not pass
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_whole_suite_is_there():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in DOCS}
    for name in ("registry", "router", "gateway", "decode", "prefill", "autoscaler"):
        assert ("Deployment", name) in kinds
    assert ("StatefulSet", "etcd") in kinds
    for name in ("gateway", "router", "registry", "decode", "prefill"):
        assert ("PodDisruptionBudget", name) in kinds
    assert all(d["metadata"].get("namespace") == "tokenfleet" for d in DOCS if d["kind"] != "Namespace")


def test_probes_scrape_annotations_gpus_and_drain():
    for w in WORKLOADS:
        pod = w["spec"]["template"]
        for c in pod["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, (w["metadata"]["name"], c["name"])
        if w["metadata"]["name"] != "etcd":
            assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    for name in ("decode", "prefill"):
        pod = by("Deployment", name)["spec"]["template"]["spec"]
        worker = pod["containers"][0]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert worker["lifecycle"]["preStop"] and pod["terminationGracePeriodSeconds"] >= 300
        assert "startupProbe" in worker  # ready only after the model is loaded and warmed up
    rules = by("Role", "autoscaler")["rules"]
    assert any("deployments/scale" in r["resources"] and "patch" in r["verbs"] for r in rules)


def test_container_args_parse_with_the_services_own_parsers():
    from tokenfleet.cli import build_parser

    parser = build_parser()
    for w in WORKLOADS:
        if w["metadata"]["name"] == "etcd":
            continue
        args = [a.replace("$(POD_IP)", "10.0.0.1").replace("$(POD_NAME)", "pod-0")
                for a in w["spec"]["template"]["spec"]["containers"][0]["args"]]
        command = args[0]
        if command in ("decode", "prefill", "router", "gateway", "registry"):
            module = {"decode": "worker", "prefill": "worker"}.get(command, command)
            main = __import__(f"tokenfleet.services.{module}.main", fromlist=["parse_args"])
            parsed = main.parse_args(args[1:], command) if module == "worker" else main.parse_args(args[1:])
            assert parsed.etcd == "etcd:2379"  # every service finds etcd by the Service the manifests define
        else:
            parsed = parser.parse_args(args)
            assert parsed.func.__name__ == "run_command" and parsed.driver == "kubernetes"  # `tokenfleet autoscale`
