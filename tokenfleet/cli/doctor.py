"""`tokenfleet doctor`: what to run when answers or speed look wrong (as `vllm collect-env` or `nvidia-smi` are run).

It reports, in this order: the machine (CPU model, usable cores, the instruction sets the kernels use, GPUs); the
torch build; what dtype "auto" picks here; every kernel a worker would choose for the model in each dtype, run
through the same known-answer check against the torch reference a worker runs at load (models.kernel_check) with
its result, error and cost; the imported model folders and their checksums; the internal plane's certificates and
their expiry; and whether `up`'s gateway port is free. It exits 1 when a kernel failed its check or a certificate
has expired, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import socket
from collections.abc import Iterator
from pathlib import Path

from tokenfleet import envs

CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def add_parser(sub: argparse._SubParsersAction) -> None:
    doc = sub.add_parser("doctor", help="check this machine: CPU and GPU, torch, each kernel against the torch "
                         "reference, model folders, certificates, ports")
    doc.add_argument("--model", help="HF model folder whose geometry the kernels are checked in (default: the "
                     "imported default model)")
    doc.add_argument("--dtype", action="append", choices=["auto", "bfloat16", "float32", "float16"],
                     help="check the kernels for this dtype (repeatable; default: what auto picks here, and bfloat16)")
    doc.add_argument("--port", type=int, default=8000, help="the gateway port `up` would use")
    doc.add_argument("--no-checksums", action="store_true", help="skip hashing the model files")
    doc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problems = 0
    for title, lines, failed in (("machine", machine(), 0), ("torch", torch_build(), 0),
                                 *kernel_sections(args.model, args.dtype), ("models", models(not args.no_checksums), 0),
                                 ("certificates", *certificates()), ("ports", ports(args.port), 0)):
        print(f"{title}:")
        for line in lines:
            print(f"  {line}")
        problems += failed
    return 1 if problems else 0


def cpu_info() -> tuple[str, set[str]]:
    from tokenfleet.models.auto_dtype import cpu_model_and_flags

    name, flags = cpu_model_and_flags()
    return name or platform.processor() or platform.machine(), set(flags)


def machine() -> list[str]:
    from tokenfleet.backends.torch.device import usable_cores

    name, flags = cpu_info()
    lines = [f"cpu: {name}, {usable_cores()} usable cores of {os.cpu_count()}",
             "instructions: " + " ".join(f"{f}{'+' if f in flags else '-'}" for f in CPU_FEATURES)]
    import torch

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"gpu {i}: {p.name}, compute capability {p.major}.{p.minor}, "
                         f"{p.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("gpu: none (CUDA not available to this torch)")
    return lines


def torch_build() -> list[str]:
    import torch

    return [f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, CPU kernels built for "
            f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads",
            f"native kernels: {'off (TOKENFLEET_NATIVE_KERNELS=0)' if not envs.native_kernels() else 'on'}, "
            f"kernel choice: {envs.kernels()} (TOKENFLEET_KERNELS)"]


def kernel_sections(model: str | None, dtypes: list[str] | None) -> Iterator[tuple[str, list[str], int]]:
    """A section per dtype: each kernel a worker would choose, checked as at load."""
    from tokenfleet.backends.torch.device import resolve_device
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.gguf_import import ensure_default_model
    from tokenfleet.models.loader import checked_kernels, choose_dtype, parse_dtype

    folder = Path(model) if model else ensure_default_model()
    config = ModelConfig.from_dir(folder)
    device = resolve_device("auto")
    auto = choose_dtype("auto", device, model_dir=folder)
    chosen = [auto.dtype if d == "auto" else d for d in dtypes or ["auto", "bfloat16"]]
    rates = ", ".join(f"{k} {v:g}" for k, v in auto.rates.items())
    yield "dtype", [f"auto picks {auto.dtype} on this {device.type} ({auto.source}): {auto.reason}",
                    *([f"measured GFLOP/s: {rates}"] if rates else []),
                    "a model record pins the first worker's choice for the whole fleet (its `numerics`); "
                    "--dtype overrides",
                    *_load_dependence()], 0
    for name in dict.fromkeys(chosen):
        _, _, checks = checked_kernels(config, parse_dtype(name), device)
        if device.type == "cpu":
            from tokenfleet.backends.torch.sampler_check import checked_native_sampler

            checks = (*checks, *checked_native_sampler()[1], *_quant_linear_checks(config, parse_dtype(name)))
        lines = [f"{c.kernel}: {c.implementation}: {'passed' if c.passed else 'FAILED: ' + c.detail}, max |error| "
                 f"{c.max_error:.3g}, {c.seconds * 1000:.0f} ms; serving: {c.serving}" for c in checks]
        lines.append(f"checks took {sum(c.seconds for c in checks):.2f} s (tolerance: {checks[0].tolerance})")
        yield f"kernels ({name}, {folder.name}: {config.num_heads} heads, {config.num_kv_heads} KV heads, head_dim "\
              f"{config.head_dim})", lines, sum(not c.passed for c in checks)


def _load_dependence() -> list[str]:
    """Which paths keep greedy answers independent of how many requests share a step, and which setting does."""
    int8 = envs.quant_activations() == "int8"
    return ["greedy answers alone and beside other requests: the same but at near-ties on dense weights "
            "(tests/model/test_batch_invariance.py)",
            "gguf and int8 records: " + (
                "decode steps of up to 4 rows multiply int8 activations (TOKENFLEET_QUANT_ACTIVATIONS=int8), longer "
                "steps float ones, so their answers can change with the load; TOKENFLEET_QUANT_ACTIVATIONS=float with "
                "--dtype float32 keeps them load-independent" if int8 else
                "float activations (TOKENFLEET_QUANT_ACTIVATIONS=float): load-independent with --dtype float32")]


def _quant_linear_checks(config, dtype):  # type: ignore[no-untyped-def]
    """The GGUF kernel (models.quant_linear) on each GGML type, in the model's width rounded to whole 256-value
    blocks (as a GGUF record's layers would be checked at load)."""
    from tokenfleet.models.ggml_quant import TYPES
    from tokenfleet.models.kernel_check import checked_quant_linear
    from tokenfleet.models.quant_linear import select_quant_linear

    cols = max(256, config.hidden_size // 256 * 256)
    return checked_quant_linear(select_quant_linear(), {(kind, cols, cols) for kind in TYPES}, dtype)[1]


def models(checksums: bool) -> list[str]:
    root = envs.cache_dir() / "models"
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []
    if not folders:
        return [f"none imported under {root} (`tokenfleet models import`)"]
    lines = []
    for folder in folders:
        files = sorted(folder.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        missing = [n for n in ("config.json", "tokenizer.json") if not (folder / n).exists()]
        digest = ""
        if checksums:
            h = hashlib.sha256()
            for f in files:
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 22), b""):
                        h.update(chunk)
            digest = f", sha256 {h.hexdigest()[:16]}"
        state = f"missing {', '.join(missing)}" if missing else "complete"
        lines.append(f"{folder.name}: {folder}, {len(files)} safetensors file(s), {size / 2**20:.0f} MiB{digest}, "
                     f"{state}")
    return lines


def certificates() -> tuple[list[str], int]:
    from cryptography import x509

    folder = envs.certs_dir()
    pems = sorted(folder.glob("*.pem")) if folder.exists() else []  # tokenfleet certs: ROLE.pem beside ROLE.key
    if not pems:
        return [f"none under {folder} (`tokenfleet certs`; `up` creates them)"], 0
    now = datetime.datetime.now(datetime.UTC)
    lines, expired = [], 0
    for path in pems:
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
        except ValueError:
            continue
        left = cert.not_valid_after_utc - now
        expired += left.total_seconds() <= 0
        lines.append(f"{path.name}: expires {cert.not_valid_after_utc:%Y-%m-%d} "
                     f"({'EXPIRED' if left.total_seconds() <= 0 else f'in {left.days} days'})")
    return lines, expired


def ports(port: int) -> list[str]:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return [f"127.0.0.1:{port} (the gateway's): in use ({e.strerror}); `up --port N` picks another"]
    return [f"127.0.0.1:{port} (the gateway's): free; every other service of `up` takes a free port"]
