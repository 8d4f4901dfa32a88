"""What a person reads: the metrics logger, the end-of-run summary, the precision doctor, plots, quiet logs.

Reads files and tensors only; imports neither megatron.core nor vLLM.
"""
