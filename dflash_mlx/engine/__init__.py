"""The decode engine: a request's setup and prefill, the cycle (draft, verify, accept,
commit) alone and batched, trees, sampling, logits processors and grammars, replies."""
