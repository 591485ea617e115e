"""Test layer shared by every model's tests: tiny checkpoints, a real
`vllm serve` harness, parity helpers and the evidence writer.

Nothing here is imported by serving code.
"""
