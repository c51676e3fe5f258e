"""The TensorRT-LLM adapter against the test double of the documented API (tests/trtllm_double.py):
parameter translation, delta assembly, the disaggregated hand-off, error mapping, stats and KV
events, aborts; and that nothing imports tensorrt_llm unless this backend is chosen."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys

import pytest

from tests import trtllm_double as double
from tokenfleet.backends.trtllm import translate
from tokenfleet.backends.trtllm.engine import TrtllmEngine
from tokenfleet.backends.trtllm.spec import PYTORCH, TRT_ENGINE, TrtllmSpec, llm_class, llm_kwargs
from tokenfleet.engine.grammar import Guided
from tokenfleet.engine.interface import Engine, EngineStoppedError
from tokenfleet.engine.kv_transfer import Handoff, KVLayoutError, PrefillStarted
from tokenfleet.engine.request import FinishReason
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.kvcache.block_hash import hash_blocks
from tokenfleet.kvcache.layout import KVLayout

PROMPT = list(range(100, 170))  # 70 tokens: 2 full blocks of 32


def engine(api=None, **spec) -> TrtllmEngine:
    options = {"model": "/models/engine", "kind": TRT_ENGINE, "tokenizer": "/models/tokenizer", **spec}
    return TrtllmEngine(TrtllmSpec(**options), "salt", vocab_size=1000, max_model_len=4096,
                        api_loader=lambda: api or double.api(), transfer_timeout=2.0)


async def collect(stream) -> list:
    return [out async for out in stream]


def tokens_by_index(outputs) -> dict[int, list[int]]:
    result: dict[int, list[int]] = {}
    for out in outputs:
        result.setdefault(out.index, []).extend(out.new_token_ids)
    return result


def test_importing_tokenfleet_never_imports_tensorrt_llm():
    code = ("import sys, tokenfleet, tokenfleet.backends.trtllm, tokenfleet.backends.trtllm.engine, "
            "tokenfleet.services.worker.main, tokenfleet.services.gateway.app, tokenfleet.cli; "
            "assert 'tensorrt_llm' not in sys.modules, 'imported'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ---- translation ----------------------------------------------------------------------------------------
def test_sampling_translation_is_fresh_explicit_and_greedy_by_top_k():
    api = double.api()
    greedy = translate.sampling(api, SamplingParams(max_tokens=None, temperature=0.0), max_tokens=500)
    assert greedy.max_tokens == 500 and greedy.top_k == 1 and greedy.temperature is None and greedy.top_p is None
    p = SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, top_k=0, seed=3, stop=["x"], logprobs=2,
                       presence_penalty=0.5, n=2)
    a, b = translate.sampling(api, p, 20), translate.sampling(api, p, 20)
    assert a is not b and (a.temperature, a.top_p, a.top_k, a.seed, a.stop, a.logprobs, a.n) == \
        (0.7, 0.9, None, 3, ["x"], 2, 2)
    assert a.presence_penalty == 0.5 and a.frequency_penalty is None
    context = translate.sampling(api, p, 20, context_only=True)
    assert context.max_tokens == 1 and context.n == 1


def test_guided_translation_and_backend_limits():
    api = double.api()
    schema = {"type": "object"}
    g = translate.sampling(api, SamplingParams(guided=Guided("json_schema", json.dumps(schema))), 10,
                           guided_backend="xgrammar").guided_decoding
    assert g.json == schema
    assert translate.sampling(api, SamplingParams(guided=Guided("json_object")), 10,
                              guided_backend="xgrammar").guided_decoding.json_object
    with pytest.raises(ValueError, match="llguidance"):  # our Lark dialect (tool calls) needs llguidance
        translate.sampling(api, SamplingParams(guided=Guided("lark", "start: /a+/")), 10, guided_backend="xgrammar")
    assert translate.sampling(api, SamplingParams(guided=Guided("lark", "start: /a+/")), 10,
                              guided_backend="llguidance").guided_decoding.grammar == "start: /a+/"
    with pytest.raises(ValueError, match="off"):
        translate.sampling(api, SamplingParams(guided=Guided("json_object")), 10, guided_backend=None)


def test_logit_bias_becomes_an_embedding_bias():
    api = double.api()
    sp = translate.sampling(api, SamplingParams(logit_bias={5: -100.0, 7: 2.5}), 10, vocab_size=16)
    assert sp.embedding_bias.tolist()[5] == -100.0 and sp.embedding_bias.tolist()[7] == 2.5
    with pytest.raises(ValueError, match="vocabulary"):
        translate.sampling(api, SamplingParams(logit_bias={99: 1.0}), 10, vocab_size=16)


@pytest.mark.parametrize(("kind", "role"), [(TRT_ENGINE, "both"), (TRT_ENGINE, "prefill"), (PYTORCH, "decode"),
                                            (PYTORCH, "prefill")])
def test_constructor_arguments_fit_each_llm_class(kind, role):
    api = double.api()
    spec = TrtllmSpec(model="/m", kind=kind, role=role, kv_max_gpu_bytes=2**30,
                      guided_decoding_backend="xgrammar" if kind == TRT_ENGINE else "llguidance")
    kwargs = llm_kwargs(api, spec)
    llm = llm_class(api, spec)(model="/m", **kwargs)  # the double's constructor is strict, like the library's
    assert llm.kv.event_buffer_max_size > 0 and llm.kv.max_gpu_total_bytes == 2**30
    transceiver = kwargs["cache_transceiver_config"]  # every role: "both" workers serve Prefill too
    assert transceiver.backend == "UCX" and transceiver.kv_transfer_timeout_ms == 60_000
    assert (llm.kv.dtype == "fp8") == (kind == PYTORCH)
    with pytest.raises(ValueError, match="xgrammar"):
        TrtllmSpec(model="/m", kind=TRT_ENGINE, guided_decoding_backend="llguidance")


def test_disaggregated_params_round_trip_every_field():
    api = double.api()
    params = api.DisaggregatedParams(request_type="context_only", first_gen_tokens=[42], ctx_request_id=7,
                                     opaque_state=bytes(range(256)), draft_tokens=[1, 2], disagg_request_id=99)
    back = translate.decode_disagg(api, translate.encode_disagg(params))
    assert back.request_type == "generation_only"
    for name in ("first_gen_tokens", "ctx_request_id", "opaque_state", "draft_tokens", "disagg_request_id"):
        assert getattr(back, name) == getattr(params, name), name
    with pytest.raises(ValueError, match="hand-off"):
        translate.decode_disagg(api, b"not json")


def test_stats_and_kv_events_become_our_signals():
    gauges = translate.gauges({"numActiveRequests": 3, "numQueuedRequests": 4, "iterLatencyMS": 12.0,
                               "kvCacheStats": {"usedNumBlocks": 10, "freeNumBlocks": 90},
                               "inflightBatchingStats": {"numPausedRequests": 1}})
    assert gauges == {"num_running": 3, "num_waiting": 5, "num_blocks_used": 10, "num_blocks_free": 90,
                      "last_step_seconds": 0.012}
    assert translate.gauges({}) == {"num_running": 0, "num_waiting": 0}  # keys a release lacks are skipped
    mirror = translate.BlockHashMirror("salt", 4)
    tokens = list(range(12))
    mirror.apply({"data": {"type": "stored", "parent_hash": None, "blocks": [
        {"block_hash": 1, "tokens": [{"token_id": t} for t in tokens[0:4]]},
        {"block_hash": 2, "tokens": [{"token_id": t} for t in tokens[4:8]]}]}})
    mirror.apply({"data": {"type": "stored", "parent_hash": 2, "blocks": [{"block_hash": 3, "tokens": tokens[8:12]}]}})
    assert mirror.hashes == set(hash_blocks(tokens, 4, "salt"))  # what the router computes for this prompt
    mirror.apply({"data": {"type": "removed", "block_hashes": [3]}})
    assert mirror.hashes == set(hash_blocks(tokens, 4, "salt")[:2])
    mirror.apply({"data": {"type": "stored", "parent_hash": 777, "blocks": [{"block_hash": 4, "tokens": tokens[:4]}]}})
    assert len(mirror.hashes) == 2  # a parent never seen: not routable


# ---- the engine ---------------------------------------------------------------------------------------------
def test_streaming_deltas_assemble_without_duplicates_and_params_are_not_reused():
    async def run():
        e = engine()
        await e.start()
        assert isinstance(e, Engine)
        outs = await collect(e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=9, temperature=0.0), "a")))
        again = await collect(e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=9, temperature=0.0), "b")))
        two = await collect(e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=5, temperature=0.8, seed=1, n=2), "c")))
        llm = e.llm
        await e.shutdown()
        return outs, again, two, llm

    outs, again, two, llm = asyncio.run(run())
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 9 and tokens == [t for o in again for t in o.new_token_ids]
    assert "".join(o.text for o in outs) == "".join(f"t{t} " for t in tokens)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 9
    assert sum(o.finished for o in outs) == 1
    by_index = tokens_by_index(two)
    assert sorted(by_index) == [0, 1] and all(len(v) == 5 for v in by_index.values())
    assert sum(o.finished for o in two) == 2
    submitted = [sp for _, sp, _ in llm.submitted[1:]]  # [0] is the health generation
    assert len({id(sp) for sp in submitted}) == len(submitted)  # a fresh, library-mutated object per request
    assert all(sp.end_id == double.EOS for sp in submitted) and submitted[0].max_tokens == 9


def test_closing_the_stream_aborts_the_library_request_and_abort_by_id_works():
    async def run():
        e = engine()
        await e.start()
        stream = e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=500, temperature=0.0), "x"))
        first = await anext(stream)
        await stream.aclose()
        other = e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=500, temperature=0.0), "y"))
        outs = [await anext(other)]
        await e.abort("y")
        outs += [o async for o in other]
        aborted = list(e.llm.aborted)
        await e.shutdown()
        return first, outs, aborted, e

    first, outs, aborted, e = asyncio.run(run())
    assert first.new_token_ids and len(aborted) == 2
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
    assert not e._handles


def test_request_errors_are_the_requests_fault_other_errors_fail_the_engine():
    async def run(api):
        e = engine(api)
        await e.start()
        return e

    e = asyncio.run(run(double.api()))

    async def submit_empty():
        return await collect(e.generate(RequestSpec([], SamplingParams(max_tokens=3), "bad")))
    with pytest.raises(ValueError):
        asyncio.run(submit_empty())
    assert e.error is None

    class Boom(Exception):
        pass

    api = double.api()

    async def failing():
        e = await run(api)
        for instance in api.instances:
            instance.fail_with = Boom("device lost")
        with pytest.raises(EngineStoppedError):
            await collect(e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=3), "z")))
        assert isinstance(e.error, Boom)
        with pytest.raises(EngineStoppedError):
            await collect(e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=3), "after")))
        api.instances[0].fail_with = double.RequestError("bad guide")
        e.error, e._accepting = None, True
        with pytest.raises(RuntimeError, match="bad guide"):
            await collect(e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=3), "req-error")))
        assert e.error is None  # a per-request error leaves the engine healthy
    asyncio.run(failing())


def test_health_check_is_a_real_generation():
    async def run():
        e = engine(double.api(hang=True))
        with pytest.raises(EngineStoppedError, match="health"):
            e.api = double.api(hang=True)
            e.llm = e.api.TrtEngineLLM("/m")
            await e.health_check(timeout=0.2)
        return e

    e = asyncio.run(run())
    assert e.error is not None and not e._accepting


def test_stats_and_prefix_hashes_flow_from_the_pollers():
    async def run():
        e = engine(block_reuse=True)
        await e.start()
        busy = []
        async for _ in e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=40, temperature=0.0), "s")):
            await asyncio.sleep(0.005)  # let the stats poller run between iterations
            busy.append(e.stats().num_running)
        for _ in range(100):
            if e.cached_block_hashes() and e.stats().num_blocks_used:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the last iteration's stat (still counting the request) has arrived
        stats, hashes, last_raw = e.stats(), e.cached_block_hashes(), e._stats.num_running
        await e.shutdown()
        return busy, stats, hashes, last_raw

    busy, stats, hashes, last_raw = asyncio.run(run())
    assert max(busy) == 1 and stats.num_blocks_used == 2 and stats.num_finished == 1
    # Found in review: stats stop when the library idles, and the last said "1 running" forever.
    assert last_raw == 1 and (stats.num_running, stats.num_waiting) == (0, 0)
    assert hashes == set(hash_blocks(PROMPT, 32, "salt"))


def test_gauges_never_exceed_the_requests_we_hold():
    e = engine()
    e._on_stat({"numActiveRequests": 5, "numQueuedRequests": 4, "inflightBatchingStats": {"numPausedRequests": 1}})
    assert (e.stats().num_running, e.stats().num_waiting) == (0, 0)
    e._handles = {"a": object(), "b": object(), "c": object()}
    assert (e.stats().num_running, e.stats().num_waiting) == (3, 0)
    e._on_stat({"numActiveRequests": 1, "numQueuedRequests": 1, "inflightBatchingStats": {"numPausedRequests": 3}})
    assert (e.stats().num_running, e.stats().num_waiting) == (1, 2)


# ---- disaggregation -----------------------------------------------------------------------------------------------
def pair(fabric=None, **options):
    fabric = fabric or double.Fabric()
    return (engine(double.api(fabric=fabric, **options), role="prefill"),
            engine(double.api(fabric=fabric, **options), role="decode"))


def source_of(prefill: TrtllmEngine, params: SamplingParams, request_id: str, log: list | None = None):
    def open_transfer(held, layout):
        async def events():
            async with contextlib.aclosing(prefill.prefill(RequestSpec(PROMPT, params, request_id, 0), held, layout)) as stream:
                async for event in stream:
                    if log is not None:
                        log.append(event)
                    yield event
        return events()
    return open_transfer


def test_context_only_then_generation_only_equals_aggregated_without_a_duplicate_first_token():
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def run():
        prefill, decode = pair()
        alone = engine()
        for e in (prefill, decode, alone):
            await e.start()
        log: list = []
        disagg = await collect(decode.generate(RequestSpec(PROMPT, params, "d", kv_source=source_of(prefill, params, "d", log))))
        aggregated = await collect(alone.generate(RequestSpec(PROMPT, params, "a")))
        submitted = (prefill.llm.submitted[-1], decode.llm.submitted[-1])
        for e in (prefill, decode, alone):
            await e.shutdown()
        return disagg, aggregated, log, submitted, decode

    disagg, aggregated, log, (ctx, gen), decode = asyncio.run(run())
    assert [type(e) for e in log] == [PrefillStarted, Handoff]  # the decode side needs nothing after the hand-off
    got = [t for o in disagg for t in o.new_token_ids]
    assert got == [t for o in aggregated for t in o.new_token_ids] and len(got) == 8
    assert got[0] == log[0].token_id and got.count(got[0]) == 1
    assert ctx[2].request_type == "context_only" and ctx[1].max_tokens == 1  # set by us: TRT does not force it
    assert gen[2].request_type == "generation_only" and gen[1].max_tokens == 8 and gen[0] == PROMPT
    assert decode.stats().num_remote_prefills == 1


def test_a_first_token_that_ends_the_request_skips_the_decode_phase():
    async def run():
        prefill, decode = pair(eos_after=0)
        for e in (prefill, decode):
            await e.start()
        params = SamplingParams(max_tokens=8, temperature=0.0)
        outs = await collect(decode.generate(RequestSpec(PROMPT, params, "d", kv_source=source_of(prefill, params, "d"))))
        generation_submitted = len(decode.llm.submitted)
        for e in (prefill, decode):
            await e.shutdown()
        return outs, generation_submitted

    outs, submitted = asyncio.run(run())
    assert [o.new_token_ids for o in outs] == [[double.EOS]] and outs[0].finish_reason is FinishReason.STOP
    assert submitted == 1  # only the health generation: no generation_only request


def test_a_torch_engine_layout_is_refused_and_a_failed_hand_off_prefills_locally():
    torch_layout = KVLayout("salt", "bfloat16", 16, 30, 3, 64)

    async def run():
        prefill, decode = pair()
        for e in (prefill, decode):
            await e.start()
        with pytest.raises(KVLayoutError):
            await collect(prefill.prefill(RequestSpec(PROMPT, SamplingParams(max_tokens=4), "p", 0), (), torch_layout))

        def failing(held, layout):
            async def events():
                from tokenfleet.engine.kv_transfer import KVTransferError
                raise KVTransferError("prefill replica unreachable")
                yield  # pragma: no cover
            return events()

        outs = await collect(decode.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=4, temperature=0.0), "d",
                                                         kv_source=failing)))
        stats = decode.stats()
        for e in (prefill, decode):
            await e.shutdown()
        return outs, stats

    outs, stats = asyncio.run(run())
    assert len([t for o in outs for t in o.new_token_ids]) == 4 and stats.num_remote_fallbacks == 1


def test_a_refused_generation_only_request_prefills_locally():
    """The context state expired before the decode side submitted (kv_transfer_timeout_ms)."""
    params = SamplingParams(max_tokens=5, temperature=0.0)

    async def run():
        fabric = double.Fabric()
        prefill, decode = pair(fabric)
        for e in (prefill, decode):
            await e.start()

        def expiring(held, layout):
            async def events():
                async for event in source_of(prefill, params, "d")(held, layout):
                    if isinstance(event, Handoff):
                        fabric.pending.clear()  # the transceiver dropped it
                    yield event
            return events()

        outs = await collect(decode.generate(RequestSpec(PROMPT, params, "d", kv_source=expiring)))
        stats = decode.stats()
        for e in (prefill, decode):
            await e.shutdown()
        return outs, stats

    outs, stats = asyncio.run(run())
    assert len([t for o in outs for t in o.new_token_ids]) == 5 and outs[-1].finished
    assert (stats.num_remote_prefills, stats.num_remote_fallbacks) == (0, 1)


def test_a_wedged_transfer_times_out_and_prefills_locally():
    """Found in review: generation_only never producing (a transceiver that waits forever) must not
    hold the request: after the transfer timeout it is aborted and the prompt is prefilled here."""
    params = SamplingParams(max_tokens=5, temperature=0.0)

    async def run():
        fabric = double.Fabric()
        prefill = engine(double.api(fabric=fabric), role="prefill")
        decode = engine(double.api(fabric=fabric, wedge_transfers=True), role="decode")
        decode.transfer_timeout = 0.3
        for e in (prefill, decode):
            await e.start()
        outs = await collect(decode.generate(RequestSpec(PROMPT, params, "d", kv_source=source_of(prefill, params, "d"))))
        stats, llm = decode.stats(), decode.llm
        for e in (prefill, decode):
            await e.shutdown()
        return outs, stats, llm

    outs, stats, llm = asyncio.run(run())
    kinds = [d.request_type if d else None for _, _, d in llm.submitted]
    assert kinds == [None, "generation_only", None]  # health probe, the wedged hand-off, the local prefill
    assert 2 in llm.aborted  # the wedged generation_only request was freed, not left pinned
    assert len([t for o in outs for t in o.new_token_ids]) == 5 and outs[-1].finished
    assert (stats.num_remote_prefills, stats.num_remote_fallbacks) == (0, 1)


def test_an_engine_dir_decides_kv_dtype_block_size_and_tp(tmp_path):
    """Found in review: FP8 KV and tokens per block are baked into a TRT engine; reading them from the
    record (or the worker's default 32) could hash prompts with the wrong block size."""
    from types import SimpleNamespace

    (tmp_path / "rank0.engine").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({
        "pretrained_config": {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None},
                              "mapping": {"tp_size": 4}},
        "build_config": {"plugin_config": {"tokens_per_block": 64}}}))
    record = SimpleNamespace(path=str(tmp_path), tensor_parallel_size=1, quantization="fp8")
    spec = TrtllmSpec.from_record(record, "decode", tokens_per_block=None)
    assert (spec.kind, spec.kv_fp8, spec.tokens_per_block, spec.tensor_parallel_size) == (TRT_ENGINE, False, 64, 4)
    with pytest.raises(ValueError, match="tokens_per_block=64"):
        TrtllmSpec.from_record(record, "decode", tokens_per_block=32)
    checkpoint = SimpleNamespace(path=str(tmp_path / "none"), tensor_parallel_size=2, quantization="fp8")
    spec = TrtllmSpec.from_record(checkpoint, "decode")  # a checkpoint: the record and flags decide
    assert (spec.kind, spec.kv_fp8, spec.tokens_per_block, spec.tensor_parallel_size) == (PYTORCH, True, 32, 2)
    kv_only = SimpleNamespace(path=str(tmp_path / "none"), tensor_parallel_size=1, quantization="", kv_cache_dtype="fp8")
    assert TrtllmSpec.from_record(kv_only, "decode").kv_fp8  # the record's kv_cache_dtype turns on FP8 KV alone
    plain = SimpleNamespace(path=str(tmp_path / "none"), tensor_parallel_size=1, quantization="", kv_cache_dtype="")
    assert not TrtllmSpec.from_record(plain, "decode").kv_fp8


def test_the_operator_smoke_script_passes_against_the_double(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"pretrained_config": {"vocab_size": 1000},
                                                      "build_config": {"max_seq_len": 2048}}))
    (tmp_path / "rank0.engine").write_bytes(b"")
    done = subprocess.run([sys.executable, "scripts/trtllm_smoke.py", "--model", str(tmp_path), "--tokenizer",
                           str(tmp_path), "--api", "tests.trtllm_double:api"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "5/5 steps passed" in done.stdout, done.stdout + done.stderr
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("PASS")] == \
        ["load", "stream", "abort", "stats", "disagg"]


def test_a_record_names_the_speculative_config_and_a_wedged_engine_fails_its_periodic_check():
    from types import SimpleNamespace

    record = SimpleNamespace(path="/ckpt", tensor_parallel_size=2, quantization="fp8",
                             speculative_config='{"decoding_type": "Eagle", "max_draft_len": 4}')
    spec = TrtllmSpec.from_record(record, "decode")
    assert spec.speculative == {"decoding_type": "Eagle", "max_draft_len": 4} and spec.kind == PYTORCH
    assert llm_kwargs(double.api(), spec)["speculative_config"]["decoding_type"] == "Eagle"
    # one record schema for both engines: NGram goes to TensorRT-LLM without the keys only the torch engine reads
    ngram = SimpleNamespace(path="/ckpt", tensor_parallel_size=1, quantization="",
                            speculative_config='{"decoding_type": "NGram", "max_draft_len": 5, "adaptive": false, '
                            '"max_matching_ngram_size": 3}')
    assert llm_kwargs(double.api(), TrtllmSpec.from_record(ngram, "both"))["speculative_config"] == \
        {"decoding_type": "NGram", "max_draft_len": 5, "max_matching_ngram_size": 3}

    async def run():
        api = double.api()
        e = engine(api)
        e.health_interval = 0.05
        await e.start()
        api.instances[0].hang = True  # the engine wedges: generations never finish
        original = e.health_check
        e.health_check = lambda timeout=0.2: original(timeout)
        for _ in range(100):
            if e.error is not None:
                break
            await asyncio.sleep(0.05)
        await e.shutdown()
        return e

    e = asyncio.run(run())
    assert e.error is not None and not e._accepting


def test_prompt_logprobs_reach_our_outputs():
    """Found in review: prompt logprobs (echo with logprobs) were asked of the library but dropped."""
    async def run():
        e = engine(gather_generation_logits=True)
        await e.start()
        outs = await collect(e.generate(RequestSpec(PROMPT, SamplingParams(max_tokens=2, temperature=0.0,
                                                    prompt_logprobs=0), "e")))
        with pytest.raises(ValueError, match="gather-generation-logits"):  # TRT engines without gathered logits
            await collect(engine().generate(RequestSpec(PROMPT, SamplingParams(max_tokens=2, logprobs=1), "x")))
        await e.shutdown()
        return outs

    outs = asyncio.run(run())
    assert [lp.token_id for lp in outs[0].prompt_logprobs] == PROMPT[1:]
    assert all(not o.prompt_logprobs for o in outs[1:])
