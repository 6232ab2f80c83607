"""Which versions may have computed a vLLM request's prompt logprobs (``prompt_logprobs``).

vLLM computes a prompt's logprobs in its prefill: the forward that also samples the
request's first token (several forwards, one chunk of the prompt each, where chunked
prefill splits a long prompt; the last of them samples the first token). The replica
does not see vLLM's steps, only the request's span (loader/spans.py): every version
served from its admission to vLLM's answer. So the prompt's logprobs are exactly the
span's version when the span has one, and may be any of its versions when the request
crossed a hot-load (a swap in the middle of a chunked prefill even splits them); a
request on a LoRA slot is pinned to one version and always has one.
"""

from __future__ import annotations

from typing import Any


def prompt_logprobs_versions(body: dict[str, Any], versions: list[int | None]) -> list[int | None] | None:
    """The versions that may have computed the prompt logprobs ``body`` asked vLLM for (the request's span
    ``versions``, see the module docstring); None when it asked for none, so that engine_data says nothing of
    them."""
    if body.get("prompt_logprobs") is None:
        return None
    return list(versions)
