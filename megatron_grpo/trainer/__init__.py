"""The GRPO trainer: the loop, building a run, one step, Megatron's DDP/optimizer, forwards, the memory plan."""
