"""TensorRT-LLM engine backend (optional extra ``tokenfleet[trtllm]``).

``TrtllmEngine`` implements the same ``Engine`` interface as our torch engine on top of
``tensorrt_llm``'s LLM API (prebuilt TRT engines through ``tensorrt_llm._tensorrt_engine.LLM``,
HF/ModelOpt checkpoints through the PyTorch-backend ``tensorrt_llm.LLM``), including the
disaggregated roles: the prefill role runs ``context_only`` requests and hands their
``DisaggregatedParams`` over our ``Prefill`` RPC; the decode role runs ``generation_only``.

Nothing in this package imports ``tensorrt_llm`` at module level: ``load_api()`` does, when a
worker is started with this backend. Facts the code relies on (signatures, the mutated
SamplingParams, the first-token rule, stats keys) come from shared/reference/trtllm-api.md.
"""
