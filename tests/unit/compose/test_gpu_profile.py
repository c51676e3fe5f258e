"""The compose `gpu` profile: TensorRT-LLM workers launched the way the library needs (mpirun +
trtllm-llmapi-launch, IPC, memlock and stack limits, GPUs reserved) with a tokenfleet worker
command that the worker's own parser accepts."""

from __future__ import annotations

from pathlib import Path

from tokenfleet.services.worker.main import parse_args as worker_args

from tests.unit.compose.files import flag, services

ROOT = Path(__file__).resolve().parents[3]


def gpu_services() -> dict:
    return {name: svc for name, svc in services().items() if "gpu" in svc.get("profiles", [])}


def test_gpu_workers_launch_under_mpi_and_parse():
    gpu = gpu_services()
    assert set(gpu) == {"trt-prefill", "trt-decode"}
    for name, svc in gpu.items():
        argv = [str(w) for w in svc["command"]]
        assert argv[0] == "mpirun" and "trtllm-llmapi-launch" in argv
        worker = argv[argv.index("trtllm-llmapi-launch") + 1:]
        assert worker[0] == "tokenfleet" and worker[1] == name.removeprefix("trt-")
        args = worker_args(worker[2:], default_role=worker[1])
        assert args.backend == "trtllm" and args.kv_transfer_timeout_ms > 0
        port = flag(worker, "--port")
        assert port in [str(p) for p in svc["expose"]] and f"127.0.0.1:{port}" in " ".join(svc["healthcheck"]["test"])
        assert flag(worker, "--advertise-address") == f"{name}:{port}"


def test_gpu_workers_get_gpus_shared_ipc_and_limits_from_the_trtllm_image():
    for svc in gpu_services().values():
        assert svc["ipc"] == "host" and svc["ulimits"] == {"memlock": -1, "stack": 67108864}
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert svc["build"]["dockerfile"] == "compose/Dockerfile.trtllm"
    dockerfile = (ROOT / "compose/Dockerfile.trtllm").read_text()
    assert "nvcr.io/nvidia/tensorrt-llm/release:1.2." in dockerfile
    assert "import tensorrt_llm, tokenfleet.backends.trtllm.engine" in dockerfile  # the image fails early
