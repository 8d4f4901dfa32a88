"""Megatron -> generator weight transport: gather and buckets, fan-out, vLLM's weight-transfer API, gloo."""
