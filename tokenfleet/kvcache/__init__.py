"""What every component that reasons about KV blocks must agree on, with nothing else attached.

``block_hash``: the chained hash of full blocks (the prefix cache's key, the router's prefix
affinity, the simulator's cache, the TensorRT-LLM adapter's translation). ``layout``: the KV
layout contract two replicas compare before exchanging blocks. Standard library only, and no
other tokenfleet package: the engine, routing, planning, backends and services all import it.
"""
