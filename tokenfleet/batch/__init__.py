"""The OpenAI-compatible batch tier: files, batches and their lines (store.py); the gateway serves and runs them."""
