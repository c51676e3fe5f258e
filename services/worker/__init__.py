"""The engine worker shared by the decode and prefill roles: process setup (main.py) and the EngineService
(servicer.py). `services/decode` and `services/prefill` are its entry points, one per role."""
