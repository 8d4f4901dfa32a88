"""``megatron-grpo train RECIPE.yaml [key=value ...]``: load and validate the recipe, then train or dry-run.

Light: the trainer (megatron.core, vLLM) is imported only when a run really starts.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from typing import Dict, Optional, Sequence

from megatron_grpo.config.recipe import load_recipe
from megatron_grpo.models.qwen3 import load_hf_config, shape_from_hf
from megatron_grpo.parallel import state
from megatron_grpo.trainer.layout import check_machine, check_memory, describe_layout, resolve_model_dir

logger = logging.getLogger(__name__)


def _print_dry_run(described: Dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps({k: v for k, v in described.items() if not k.endswith("_table")}, indent=2))
        return
    layout = ", ".join(f"{k}={v}" for k, v in described["layout"].items())
    print(f"layout: {layout}")
    print(described["engines_table"])
    if described["engine_args"]:  # what a vLLM server started by hand needs for generation_dtype fp8
        env = " ".join(f"{k}={v}" for k, v in described["engine_env"].items())
        print(f"FP8 engines run with {env} and: {shlex.join(described['engine_args'])}")
    print(described["memory_table"] or "memory plan: none (policy.model_name is not a local HF checkpoint dir)")


def main(recipe: str, overrides: Sequence[str], dry_run: bool = False, world_size: Optional[int] = None,
         as_json: bool = False) -> int:
    """CLI entry: load + validate the recipe (and its memory plan), then train (or print the dry run).
    After a run (finished or stopped by a signal) the trainer is dropped and every process group
    freed before the interpreter exits (``state.shutdown``); a run that raised exits with its error."""
    world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_recipe(recipe, overrides)
        if dry_run:
            _print_dry_run(describe_layout(cfg, world_size), as_json)
            return 0
        check_machine(cfg)  # before the heavy imports: a recipe this machine cannot run stops here
        if cfg.cluster.gpu_memory_gib is not None:
            check_memory(cfg, shape_from_hf(load_hf_config(resolve_model_dir(cfg))), world_size)
        from megatron_grpo.trainer.loop import GRPOTrainer  # the heavy boundary: megatron.core, vLLM

        trainer = GRPOTrainer(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logger.error("%s", exc)
        print(f"error: {exc}", flush=True)
        return 2
    code = trainer.train()
    del trainer  # the last reference to the model, optimizer and engines, which hold process groups
    state.shutdown()
    return code
