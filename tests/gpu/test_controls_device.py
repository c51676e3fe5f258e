"""Per-request controls on a tiny random Llama with a byte-level tokenizer, on the CPU and (when
present) CUDA: grammar masks, n > 1 forks with copy-on-write, logit_bias and prompt logprobs go
through the device path (masks moved to the logits' device, block copies, index_select)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.unit.models.test_llama_parity import save_tiny_llama
from tokenfleet.engine.request_spec import RequestSpec

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = 256


def save_byte_tokenizer(path) -> None:
    """256 byte tokens (GPT-2's byte alphabet) and an end token, no merges: any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: bytes(c, "utf-8"))
    byte_chars = {b: c for b, c in zip(range(256), _gpt2_byte_chars())}
    assert set(byte_chars.values()) == set(alphabet)
    vocab = {byte_chars[b]: b for b in range(256)} | {"<eos>": EOS}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    tokenizer.save(str(path / "tokenizer.json"))


def _gpt2_byte_chars() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@pytest.fixture(scope="module", params=DEVICES)
def core(request, tmp_path_factory):
    from tokenfleet.backends.torch.runner import TorchModelRunner
    from tokenfleet.engine.block_manager import BlockManager
    from tokenfleet.engine.core import EngineCore
    from tokenfleet.engine.runner import ModelInfo
    from tokenfleet.engine.scheduler import Scheduler, SchedulerConfig
    from tokenfleet.models.loader import load_model
    from tokenfleet.models.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_llama(path, num_key_value_heads=2)
    save_byte_tokenizer(path)
    model = load_model(path, torch.float32, torch.device(request.param))
    runner = TorchModelRunner(model, num_blocks=64, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_model_len=512), BlockManager(64, 4), hash_salt="dev")
    return EngineCore(scheduler, runner, Tokenizer(path), ModelInfo(vocab_size=512, max_model_len=512,
                                                                    eos_token_ids=(EOS,)))


def run(core, prompt, params):
    core.add_request(RequestSpec(prompt, params))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    core.scheduler.block_manager.check_invariants()
    assert core.scheduler.block_manager.num_used_blocks == 0
    return outs


def test_grammar_masks_hold_on_a_random_model(core):
    from tokenfleet.engine.grammar import Guided
    from tokenfleet.engine.sampling_params import SamplingParams

    prompt = core.tokenizer.encode("date: ")
    pattern = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
    for seed in range(3):  # a random model puts its mass anywhere: only the mask keeps it in the language
        outs = run(core, prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=seed,
                                                guided=Guided("regex", pattern)))
        text = "".join(o.text for o in outs)
        assert re.fullmatch(pattern, text) and outs[-1].finish_reason.value == "stop", text


def test_forks_logit_bias_and_prompt_logprobs(core):
    from tokenfleet.engine.sampling_params import SamplingParams

    prompt = list(range(40, 58))  # 18 tokens: 4 full blocks of 4 and a partial one
    before = core.scheduler.num_fork_shared_blocks, core.scheduler.num_block_copies
    outs = run(core, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, ignore_eos=True,
                                            logit_bias={300: 100.0}, prompt_logprobs=2))
    by_index: dict[int, list[int]] = {}
    for o in outs:
        by_index.setdefault(o.index, []).extend(o.new_token_ids)
    assert by_index == {i: [300] * 6 for i in range(3)}  # +100 dominates a random model's logits
    assert core.scheduler.num_fork_shared_blocks - before[0] == 2 * 5
    assert core.scheduler.num_block_copies - before[1] == 2  # the partial last block, once per fork
    firsts = [o for o in outs if o.prompt_logprobs]
    assert len(firsts) == 3 and [lp.token_id for lp in firsts[0].prompt_logprobs] == prompt[1:]
    assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in firsts[0].prompt_logprobs)
