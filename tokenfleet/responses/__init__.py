"""OpenAI's Responses API: the request and its items (``schema.py``) and stored responses (``store.py``, in the
usage ledger's database). The gateway serves it (``services/gateway/responses_api.py``)."""
