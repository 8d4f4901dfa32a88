"""Pretrains a small Qwen3-shaped model with Megatron-Core on a corpus every machine has offline.

Issue 16 item 1. The default corpus is the Python standard library's own source tree
(``sysconfig.get_paths()["stdlib"]``, ``*.py`` files, sorted; every ``--val-every``-th file is
held out for validation); ``--corpus-dir`` takes any directory of text files instead. The tool

1. trains a byte-level BPE tokenizer on the training files with ``tokenizers`` (deterministic;
   cached under ``$MEGATRON_GRPO_CACHE/pretrain-tokenizers/<corpus+settings hash>``);
2. writes a random-init HF Qwen3 checkpoint of the chosen shape (``megatron_grpo.models.tiny``)
   to ``OUT/init`` and builds it on Megatron-Core (``build_from_hf``, 1 rank);
3. trains it with torch AdamW (fp32, warmup + cosine) on next-token loss over packed
   ``--seq-len`` sequences (``forward_logits`` + ``token_log_probs``);
4. exports the weights through the package's HF name map (``export_hf_tensors``) as ``OUT``
   (config, ``model.safetensors``, tokenizer): usable as ``policy.model_name``;
5. writes ``OUT/MODEL_CARD.json`` / ``.md``: corpus, tokens seen, validation loss / perplexity
   before and after, wall time, and the rarity structure of the model's own text (share of
   sampled tokens, temperature 1, with log-prob < -5 and < -20).

    python tools/study/pretrain.py --out runs/pretrain-4m --size 4m --steps 600
    python tools/study/pretrain.py --out runs/pretrain-4m --eos-prompts   # only OUT/eos_prompts.jsonl (the EOS task)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

SIZES: Dict[str, Dict[str, int]] = {
    "1m": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=192),
    "4m": dict(layers=4, hidden=192, heads=6, kv_heads=2, head_dim=32, ffn=768),
    "10m": dict(layers=6, hidden=320, heads=10, kv_heads=5, head_dim=32, ffn=1024),
    "30m": dict(layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1536),
}
"""Total parameters with the default 4096-token vocabulary (untied embeddings): ~0.6M, ~3.7M,
~10.3M, ~29.4M. Any ``--layers/--hidden/--heads/--kv-heads/--head-dim/--ffn`` overrides a preset."""
MAX_SEQ_LEN = 512
"""``make_tiny_model`` writes ``max_position_embeddings = 512``."""
CARD_MODEL_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                   "intermediate_size", "vocab_size")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output HF checkpoint dir (also gets init/ and MODEL_CARD.*)")
    p.add_argument("--size", choices=sorted(SIZES), default="4m")
    for name in ("layers", "hidden", "heads", "kv-heads", "head-dim", "ffn"):
        p.add_argument(f"--{name}", type=int, default=None, help="overrides the --size preset")
    p.add_argument("--corpus-dir", default=None, help="default: the stdlib source tree (*.py)")
    p.add_argument("--glob-ext", default=None, help="file suffix to take (default .py for the stdlib, all files else)")
    p.add_argument("--max-corpus-mb", type=float, default=64.0)
    p.add_argument("--val-every", type=int, default=50, help="every N-th file (sorted) is validation")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--cache-dir", default=None,
                   help="tokenizer cache root (default $MEGATRON_GRPO_CACHE or ~/.cache/megatron_grpo)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-seqs", type=int, default=64, help="validation sequences scored (0 = all)")
    p.add_argument("--num-samples", type=int, default=8, help="generated continuations for the rarity structure")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eos-prompts", action="store_true",
                   help="only write OUT/eos_prompts.jsonl for the model already at OUT (write_eos_prompts)")
    args = p.parse_args(argv)
    if not 1 <= args.seq_len < MAX_SEQ_LEN or args.prompt_len + args.gen_len > MAX_SEQ_LEN:
        p.error(f"--seq-len and --prompt-len + --gen-len must be < {MAX_SEQ_LEN}")
    if not 1 <= args.prompt_len <= args.seq_len or args.val_every < 2:
        p.error("need 1 <= --prompt-len <= --seq-len and --val-every >= 2")
    return args


# ----------------------------------------------------------------------------- corpus and tokenizer


def corpus_files(root: str, ext: Optional[str]) -> List[str]:
    """Sorted (by relative path) regular files under ``root`` ending in ``ext`` (all files when None)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "site-packages")]
        found += [os.path.join(dirpath, f) for f in filenames if ext is None or f.endswith(ext)]
    return sorted((f for f in found if os.path.isfile(f)), key=lambda f: os.path.relpath(f, root))


def load_corpus(root: Optional[str], ext: Optional[str], max_mb: float, val_every: int) -> Dict:
    """Reads the corpus up to ``max_mb`` and splits it by file: every ``val_every``-th file is validation."""
    if root is None:
        root, ext = sysconfig.get_paths()["stdlib"], ext or ".py"
    texts: List[Tuple[str, str]] = []
    total, budget = 0, int(max_mb * 2 ** 20)
    for path in corpus_files(root, ext):
        with open(path, "rb") as f:
            raw = f.read()
        if not raw.strip() or total + len(raw) > budget:
            continue
        texts.append((os.path.relpath(path, root), raw.decode("utf-8", errors="replace")))
        total += len(raw)
    if len(texts) < 2:
        raise SystemExit(f"--corpus-dir {root}: need at least 2 non-empty files within --max-corpus-mb, "
                         f"found {len(texts)}")
    val_idx = {i for i in range(len(texts)) if i % val_every == val_every - 1} or {len(texts) - 1}
    train = [t for i, (_, t) in enumerate(texts) if i not in val_idx]
    val = [t for i, (_, t) in enumerate(texts) if i in val_idx]
    digest = hashlib.sha256()
    for name, text in texts:
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    meta = dict(path=os.path.abspath(root), ext=ext, files=len(texts), files_train=len(train), files_val=len(val),
                val_every=val_every, bytes=total, sha256=digest.hexdigest())
    return dict(train=train, val=val, meta=meta)


def cache_root(cache_dir: Optional[str]) -> str:
    """``--cache-dir``, else the project's model cache root (as ``megatron_grpo.models.tiny.default_model_dir``)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "megatron_grpo")
    return cache_dir or os.environ.get("MEGATRON_GRPO_CACHE", default)


def train_tokenizer(train_texts: Sequence[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``train_texts`` (the project's special tokens, EOS
    first). BPE training has no randomness: the same texts give the same merges, byte for byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_grpo.models.tiny import SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_texts, trainer=trainer)
    return tok


def cached_tokenizer(corpus: Dict, vocab_size: int, cache_dir: Optional[str]):
    """The corpus's tokenizer as ``PreTrainedTokenizerFast``, trained once per (corpus hash, split, vocab) and
    independent of ``--seed``: the same corpus gives the same ``tokenizer.json``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from megatron_grpo.models.tiny import EOS_TOKEN

    key = hashlib.sha256(f"{corpus['meta']['sha256']}|{corpus['meta']['val_every']}|{vocab_size}".encode())
    path = os.path.join(cache_root(cache_dir), "pretrain-tokenizers", key.hexdigest()[:16], "tokenizer.json")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        train_tokenizer(corpus["train"], vocab_size).save(tmp)
        os.replace(tmp, path)
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(path), eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, bos_token=None, unk_token=None, model_max_length=MAX_SEQ_LEN)
    return fast, path


def pack_rows(tokenizer, texts: Sequence[str], seq_len: int) -> torch.Tensor:
    """Every text's ids followed by EOS, concatenated and cut into ``[N, seq_len + 1]`` rows (tail dropped)."""
    eos = tokenizer.eos_token_id
    stream: List[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        stream += enc.ids + [eos]
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise SystemExit(f"corpus split of {len(stream)} tokens is shorter than one --seq-len {seq_len} row")
    return torch.tensor(stream[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


# ----------------------------------------------------------------------------- model


def model_overrides(args: argparse.Namespace, vocab_size: int) -> Dict[str, int]:
    """HF Qwen3 config fields for the chosen preset plus explicit ``--layers/--hidden/...`` flags."""
    dims = dict(SIZES[args.size])
    dims.update({k: getattr(args, k) for k in dims if getattr(args, k) is not None})
    if dims["heads"] % dims["kv_heads"]:
        raise SystemExit(f"--heads {dims['heads']} is not a multiple of --kv-heads {dims['kv_heads']}")
    return dict(vocab_size=vocab_size, num_hidden_layers=dims["layers"], hidden_size=dims["hidden"],
                num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], head_dim=dims["head_dim"],
                intermediate_size=dims["ffn"])


def write_init_checkpoint(out_dir: str, overrides: Dict[str, int], tokenizer, seed: int) -> str:
    """A seeded random-init HF Qwen3 checkpoint (``make_tiny_model``) carrying the corpus tokenizer."""
    from megatron_grpo.models.tiny import make_tiny_model

    if len(tokenizer) > overrides["vocab_size"]:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens > --vocab-size {overrides['vocab_size']}")
    make_tiny_model(out_dir, "qwen3", seed=seed, overrides=overrides)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))  # make_tiny_model's synthetic-corpus tokenizer
    tokenizer.save_pretrained(out_dir)
    return out_dir


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def token_lp(model, rows: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` fp32 log-probs of ``rows[:, 1:]`` given ``rows[:, :-1]``."""
    from megatron_grpo.parallel.logprobs import token_log_probs
    from megatron_grpo.models import forward_logits

    return token_log_probs(forward_logits(model, rows[:, :-1]), rows[:, 1:])


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token NLL (nats) over ``rows``."""
    model.eval()
    total = sum(-token_lp(model, rows[i:i + batch_size]).double().sum().item() for i in range(0, len(rows), batch_size))
    model.train()
    return total / (rows.shape[0] * (rows.shape[1] - 1))


def train(model, rows: torch.Tensor, args: argparse.Namespace) -> Dict:
    """AdamW on the mean next-token loss; seeded shuffled epochs over ``rows``. Returns timing and the loss curve."""
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=args.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, args.steps, args.min_lr_ratio))
    gen = torch.Generator().manual_seed(args.seed)
    order, cursor, curve = torch.randperm(len(rows), generator=gen), 0, []
    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(rows), generator=gen), 0
        idx = order[cursor:cursor + args.batch_size]
        cursor += args.batch_size
        loss = -token_lp(model, rows[idx]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        sched.step()
        curve.append(round(loss.item(), 5))
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {(step + 1) / (time.perf_counter() - t0):.2f} steps/s", flush=True)
    wall = time.perf_counter() - t0
    return dict(train_wall_s=wall, steps_per_s=args.steps / wall if wall > 0 else float("nan"), warmup=warmup,
                loss_curve=curve)


@torch.no_grad()
def rarity(model, val_rows: torch.Tensor, args: argparse.Namespace) -> Dict:
    """Samples ``--gen-len`` tokens (temperature 1, seeded) after ``--prompt-len``-token validation prompts,
    scores them in one forward and returns the shares of sampled tokens with log-prob < -5 and < -20."""
    from megatron_grpo.loss.metrics import COMMON_LOGPROB, RARE_LOGPROB
    from megatron_grpo.models import forward_logits

    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    pick = torch.randperm(len(val_rows), generator=gen)[:args.num_samples]
    ids = val_rows[pick, :args.prompt_len].clone()
    for _ in range(args.gen_len):
        probs = torch.softmax(forward_logits(model, ids)[:, -1].float(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    lp = token_lp(model, ids)[:, args.prompt_len - 1:].double().flatten()
    model.train()
    return dict(prompts=len(pick), prompt_len=args.prompt_len, gen_len=args.gen_len, tokens=lp.numel(),
                mean_logprob=lp.mean().item(), share_lt_minus5=(lp < COMMON_LOGPROB).double().mean().item(),
                share_lt_minus20=(lp < RARE_LOGPROB).double().mean().item(), min_logprob=lp.min().item())


def export_checkpoint(model, shape, init_dir: str, out_dir: str) -> str:
    """``init_dir``'s config / tokenizer files plus the trained weights (``export_hf_tensors``) as ``out_dir``."""
    from safetensors.torch import save_file

    from megatron_grpo.models.weights import export_hf_tensors

    for name in os.listdir(init_dir):
        if os.path.isfile(os.path.join(init_dir, name)) and name != "model.safetensors":
            shutil.copy2(os.path.join(init_dir, name), os.path.join(out_dir, name))
    tensors = {name: t.contiguous().clone() for name, t in export_hf_tensors(model, shape)}
    tmp = os.path.join(out_dir, f"model.safetensors.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    return out_dir


# ----------------------------------------------------------------------------- model card and main


def card_markdown(card: Dict) -> str:
    """A readable model card from the JSON card."""
    c, m, t, v, r = card["corpus"], card["model"], card["training"], card["validation"], card["rarity"]
    return "\n".join([
        f"# {os.path.basename(os.path.normpath(card['out']))}: locally pretrained Qwen3-shaped model", "",
        f"Command: `{card['command']}`", "",
        f"- Model: L={m['num_hidden_layers']}, d={m['hidden_size']}, heads={m['num_attention_heads']}, "
        f"kv_heads={m['num_key_value_heads']}, head_dim={m['head_dim']}, ffn={m['intermediate_size']}, "
        f"vocab={m['vocab_size']}, {m['params']:,} parameters (fp32, Megatron-Core, 1 rank)",
        f"- Corpus: `{c['path']}` ({c['ext'] or 'all files'}), {c['files']} files ({c['files_train']} train / "
        f"{c['files_val']} validation), {c['bytes']:,} bytes, {c['tokens_train']:,} train / {c['tokens_val']:,} "
        f"validation tokens, sha256 {c['sha256'][:16]}",
        f"- Tokenizer: byte-level BPE, {card['tokenizer']['size']} tokens, `{card['tokenizer']['path']}`",
        f"- Training: {t['steps']} steps x {t['batch_size']} x {t['seq_len']} tokens = {t['tokens_seen']:,} "
        f"tokens seen "
        f"({t['epochs']:.2f} epochs), AdamW lr {t['lr']} (warmup {t['warmup']}, cosine to {t['min_lr_ratio']}x), "
        f"seed {t['seed']}, {t['steps_per_s']:.2f} steps/s, wall {card['wall_time_s']:.0f} s",
        f"- Validation ({v['tokens']:,} tokens): loss {v['loss_init']:.4f} -> {v['loss']:.4f} nats, "
        f"perplexity {v['perplexity_init']:.1f} -> {v['perplexity']:.1f}",
        f"- Rarity of the model's own text ({r['tokens']} tokens sampled at temperature 1 after {r['prompts']} "
        f"validation prompts): share log-prob < -5: {r['share_lt_minus5']:.4f}, < -20: {r['share_lt_minus20']:.4f}, "
        f"mean log-prob {r['mean_logprob']:.3f}, min {r['min_logprob']:.2f}", ""])


def write_card(out_dir: str, card: Dict) -> None:
    with open(os.path.join(out_dir, "MODEL_CARD.json"), "w") as f:
        json.dump(card, f, indent=2)
    with open(os.path.join(out_dir, "MODEL_CARD.md"), "w") as f:
        f.write(card_markdown(card))


def prepare(args: argparse.Namespace) -> Tuple[Dict, object, str, Dict[str, torch.Tensor]]:
    """Corpus, tokenizer (cached), random-init checkpoint in ``OUT/init`` and the packed train / val rows."""
    corpus = load_corpus(args.corpus_dir, args.glob_ext, args.max_corpus_mb, args.val_every)
    tokenizer, tok_path = cached_tokenizer(corpus, args.vocab_size, args.cache_dir)
    init_dir = write_init_checkpoint(os.path.join(args.out, "init"), model_overrides(args, args.vocab_size),
                                     tokenizer, args.seed)
    rows = {split: pack_rows(tokenizer, corpus[split], args.seq_len) for split in ("train", "val")}
    corpus["meta"].update(tokens_train=rows["train"].numel(), tokens_val=rows["val"].numel())
    if args.val_seqs:
        rows["val"] = rows["val"][:args.val_seqs]
    return corpus["meta"], dict(path=tok_path, size=len(tokenizer)), init_dir, rows


EOS_PROMPT_TOKENS, EOS_PROMPT_OFFSETS = 48, (0, 2, 4, 8)
"""EOS-task prompts: the 48 tokens ending 0, 2, 4 or 8 tokens before the end of each validation file."""


def write_eos_prompts(model_dir: str, val_texts: Sequence[str]) -> str:
    """Writes ``model_dir/eos_prompts.jsonl`` (the write-up recipe's ``data.prompts_file``) with the model's
    tokenizer.

    The pretrained model continues a file to its end and then emits EOS, so near a file's end some samples stop
    early (reward varies within a group: GRPO has a signal), while EOS as the FIRST token, the task's optimum,
    stays rare (log-prob about -10 to -15 two or more tokens before the end): the write-up's setting."""
    from transformers import AutoTokenizer

    path = os.path.join(model_dir, "eos_prompts.jsonl")
    tok = AutoTokenizer.from_pretrained(model_dir)
    lines, n = [], EOS_PROMPT_TOKENS
    for ids in tok.backend_tokenizer.encode_batch(list(val_texts), add_special_tokens=False):
        ids = ids.ids
        lines += [json.dumps({"prompt_token_ids": ids[len(ids) - d - n:len(ids) - d]})
                  for d in EOS_PROMPT_OFFSETS if len(ids) >= d + n]
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return path


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    from megatron_grpo.models import build_from_hf, load_hf_config
    from megatron_grpo.parallel import state

    args = parse_args(argv)
    if args.eos_prompts:
        corpus = load_corpus(args.corpus_dir, args.glob_ext, args.max_corpus_mb, args.val_every)
        print(write_eos_prompts(args.out, corpus["val"]))
        return {}
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    corpus, tok, init_dir, rows = prepare(args)
    state.initialize_model_parallel(state.Layout(world_size=1), seed=args.seed)
    model, shape = build_from_hf(init_dir)
    loss_init = evaluate(model, rows["val"], args.batch_size)
    stats = train(model, rows["train"], args)
    loss = evaluate(model, rows["val"], args.batch_size)
    export_checkpoint(model, shape, init_dir, args.out)
    cfg = load_hf_config(args.out)
    tokens_seen = args.steps * args.batch_size * args.seq_len
    card = dict(
        out=os.path.abspath(args.out), corpus=corpus, tokenizer=tok,
        command="python tools/study/pretrain.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        model=dict({k: cfg[k] for k in CARD_MODEL_KEYS}, params=sum(p.numel() for p in model.parameters()),
                   size_preset=args.size),
        training=dict(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                      seed=args.seed, tokens_seen=tokens_seen, epochs=tokens_seen / max(1, corpus["tokens_train"]),
                      **stats),
        validation=dict(tokens=rows["val"].shape[0] * args.seq_len, loss_init=loss_init, loss=loss,
                        perplexity_init=math.exp(loss_init), perplexity=math.exp(loss)),
        rarity=rarity(model, rows["val"], args))
    card["wall_time_s"] = time.perf_counter() - t0
    write_card(args.out, card)
    print(card_markdown(card))
    return card


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo
    main()
