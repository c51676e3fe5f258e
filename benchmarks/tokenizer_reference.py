"""Which rebuild of a GGUF's tokenizer matches the model's own: transformers' (what our import starts from) or
llama.cpp's, judged on llama.cpp's vocabulary test files.

llama.cpp's sources ship vocabulary-only GGUFs (``models/ggml-vocab-NAME.gguf``) with test strings (``.inp``) and the
ids the model's own Hugging Face tokenizer gives them (``.out``). For each NAME this tokenizes every string with
transformers' GGUF rebuild (``AutoTokenizer.from_pretrained(gguf_file=...)``), with that rebuild as our import
writes it (the digit split restored where the GGUF's pre-tokenizer type asks for it) and with ``llama-tokenize``, and counts
the strings each gets wrong. ``starcoder`` shares SmolLM2's pre-tokenizer type (digits split one by one, then
GPT-2's byte-level pattern).

    benchmarks/peers/build_llama_cpp.sh      # prints LLAMA_BIN; the sources are beside it
    .venv/bin/python benchmarks/tokenizer_reference.py --llama-bin LLAMA_BIN [--vocabs starcoder llama-spm]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gguf_perplexity import llama_tokens
from serving.report import git_head, write_report

REPO = Path(__file__).resolve().parent.parent


def llama_ids(bin_dir: Path, gguf: Path, text: str) -> list[int]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "text.txt"
        path.write_text(text)
        return llama_tokens(bin_dir, gguf, path, bos=False)


def check(bin_dir: Path, models: Path, name: str) -> dict:
    from transformers import AutoTokenizer

    from tokenfleet.models.gguf_import import restore_digit_split
    from tokenfleet.models.tokenizer import Tokenizer

    gguf = models / f"ggml-vocab-{name}.gguf"
    inputs = (models / f"ggml-vocab-{name}.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    outputs = (models / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    hf = AutoTokenizer.from_pretrained(str(models), gguf_file=gguf.name)
    folder = Path(tempfile.mkdtemp(prefix=f"vocab-{name}-"))
    hf.save_pretrained(str(folder))
    restore_digit_split(gguf, folder / "tokenizer.json")  # what our import writes
    ours = Tokenizer(folder)
    cases = list(zip(inputs, outputs))
    wrong: dict[str, list[dict]] = {"transformers": [], "our import": [], "llama.cpp": []}
    for text, expected in cases:
        want = [int(x) for x in expected.split()]
        for who, got in (("transformers", hf.encode(text, add_special_tokens=False)), ("our import", ours.encode(text)),
                         ("llama.cpp", llama_ids(bin_dir, gguf, text))):
            if got != want:
                wrong[who].append({"text": text[:80], "got": (got or [])[:16], "want": want[:16]})
    return {"vocab": name, "cases": len(cases), "wrong": wrong}


def markdown(result: dict) -> str:
    lines = [f"# GGUF tokenizer rebuilds against the model's own tokenizer ({result['started']})", "",
             "llama.cpp's vocabulary test files (a vocabulary-only GGUF, test strings, and the ids the model's own "
             "Hugging Face tokenizer gives them), from llama-cpp-python 0.3.36's sources. Each string tokenized by "
             f"transformers' GGUF rebuild and by llama-tokenize (no BOS). git {result['git']}.", "",
             "| vocabulary | strings | transformers' rebuild wrong | our import wrong | llama.cpp wrong |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['vocab']} | {r['cases']} | {len(r['wrong']['transformers'])} | "
                     f"{len(r['wrong']['our import'])} | {len(r['wrong']['llama.cpp'])} |")
    for r in result["rows"]:
        for who, items in r["wrong"].items():
            for item in items[:5]:
                lines.append(f"- {r['vocab']}, {who}: {item['text']!r}: got {item['got']}, want {item['want']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", required=True, help="folder of llama-tokenize (build/bin in llama.cpp's sources)")
    parser.add_argument("--vocabs", nargs="+", default=["starcoder", "llama-spm"])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" /
                                             f"{time.strftime('%Y-%m-%d')}-tokenizer-reference.json"))
    args = parser.parse_args()
    bin_dir = Path(args.llama_bin)
    models = bin_dir.parent.parent / "models"
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "git": git_head(), "args": vars(args),
              "rows": [check(bin_dir, models, name) for name in args.vocabs]}
    write_report(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
