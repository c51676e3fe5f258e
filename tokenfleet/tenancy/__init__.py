"""Tenants, API keys and token budgets: pure data and arithmetic (no I/O, time passed in)."""
