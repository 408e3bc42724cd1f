"""Fine-tune a Gemma 3 as users write it: transformers' Trainer, padding-free packing, LoRA, gradient
checkpointing, bf16, and one line for backfuse.

    python examples/finetune_gemma3.py                       # a tiny random-init Gemma 3 (no download), 20 steps
    python examples/finetune_gemma3.py --compare --plot curves.png   # the unpatched model beside it, both curves
    python examples/finetune_gemma3.py --model path/to/gemma-3-1b-pt --steps 300 --tokens 8192 --compare
    python examples/finetune_gemma3.py --width gemma3-1b --layers 6 --steps 300 --tokens 4096 --compare --plot c.png

`--width` builds a released Gemma 3's width (hidden size, heads, head size, window, vocabulary) with random
weights and `--layers` layers in the released pattern (five sliding-window layers, then a global one).

The data is synthetic (no download): documents of random lengths from a tiny "language" over the first
`LANGUAGE` token ids whose next token follows from the one before it, so the loss falls.
`DataCollatorWithFlattening` packs each batch's documents into one row with position ids restarting at each
document, as padding-free training does; transformers then keeps the documents apart in its attention mask,
and backfuse's patched attention takes that mask. LoRA
(PEFT) on the attention and MLP projections is added after `backfuse.patch(model)`; the adapters run as
PEFT's modules around backfuse's attention. Gradient checkpointing and bf16 are the Trainer's own options.

Without a CUDA GPU the kernels run in the Triton interpreter (importing backfuse turns it on), so keep to
the tiny model there. What it prints: one line per step (step, loss; with --compare also the unpatched
model's loss and their relative difference), then what backfuse handed back to the model's own code
(nothing, when every call ran on backfuse's kernels).
"""

import argparse
import json
import tempfile
import time

import torch

import backfuse  # before transformers: without a GPU it turns the Triton interpreter on before triton is imported

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_config():
    """A two-layer Gemma 3 with one sliding-window and one global layer, as released models alternate them."""
    import transformers

    return transformers.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                         max_position_embeddings=512, attn_implementation="sdpa",
                                         layer_types=["sliding_attention", "full_attention"])


# Released Gemma 3 widths (their published configs), for `--width`: random weights, no download.
WIDTHS = {
    "gemma3-1b": dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512),
    "gemma3-4b": dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024),
}
LANGUAGE = 2048  # token ids the synthetic documents use (all of a smaller vocabulary)


def released_config(width: str, layers: int):
    """A Gemma 3 text config at a released width with `layers` layers, every sixth global."""
    import transformers

    return transformers.Gemma3TextConfig(**WIDTHS[width], num_hidden_layers=layers, max_position_embeddings=32768,
                                         attn_implementation="sdpa",
                                         layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                      for i in range(layers)])


def documents(count: int, vocab: int, seed: int = 0) -> list:
    """Synthetic documents of 8 to 64 tokens over ids 1..min(vocab, LANGUAGE) - 1: from a random first token, each
    next one is (5 x + 3) mod (n - 1) + 1 of the one before it."""
    vocab = min(vocab, LANGUAGE)
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(count):
        n = int(torch.randint(8, 65, (1,), generator=g))
        ids = torch.randint(1, vocab, (1,), generator=g).tolist()
        while len(ids) < n:
            ids.append((5 * ids[-1] + 3) % (vocab - 1) + 1)
        docs.append({"input_ids": ids, "labels": ids})
    return docs


def model_and_tokens(path: str | None, width: str | None = None, layers: int = 6):
    """(the model in float32 on the device, its vocabulary size): a checkpoint's, a released width's with random
    weights, or the tiny random-init one."""
    import transformers

    torch.manual_seed(0)
    if path:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa",
                                                                  torch_dtype=torch.float32)
    else:
        model = transformers.Gemma3ForCausalLM(released_config(width, layers) if width else tiny_config())
    return model.to(DEVICE), model.config.vocab_size


def train(steps: int = 20, patched: bool = True, model_path: str | None = None, tokens: int = 256, bf16: bool | None = None,
          lora: bool = True, checkpointing: bool = True, seed: int = 0, width: str | None = None, layers: int = 6,
          lr: float | None = None):
    """One fine-tuning run; returns (losses per step, backfuse.fallbacks of the model: {} when every call ran on
    backfuse's kernels)."""
    import peft
    import transformers

    model, vocab = model_and_tokens(model_path, width, layers)
    if patched:
        backfuse.patch(model, quiet=True)
    if lora:
        torch.manual_seed(seed + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj"]))
    per_batch = max(1, tokens // 36)  # documents per step: about `tokens` tokens once packed
    data = documents(steps * per_batch, vocab, seed)
    losses = []

    class Record(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    # (transformers 5.25 renamed gradient_checkpointing activation_checkpointing; earlier 5.x know the old name only)
    named = "activation" if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__ else "gradient"
    checkpoint = {f"{named}_checkpointing": checkpointing, f"{named}_checkpointing_kwargs": {"use_reentrant": False}}
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=per_batch,
            learning_rate=lr or default_lr(model_path, width, lora),
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=seed, data_seed=seed,
            bf16=torch.cuda.is_available() if bf16 is None else bf16, use_cpu=DEVICE == "cpu", **checkpoint,
            remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       data_collator=transformers.DataCollatorWithFlattening(),
                                       callbacks=[Record()])
        trainer.remove_callback(transformers.PrinterCallback)  # (this script prints the losses itself)
        trainer.train()
    return losses, backfuse.fallbacks(model)


def default_lr(model_path, width, lora: bool) -> float:
    """AdamW's learning rate: 2e-2 (LoRA) or 2e-3 for the tiny model, 1e-3 or 1e-4 at a released width."""
    tiny = not (model_path or width)
    return (2e-2 if tiny else 1e-3) if lora else (2e-3 if tiny else 1e-4)


def _plot(path: str, ours: list, theirs: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(theirs)), theirs, label="transformers (unpatched)", linewidth=2.5, alpha=0.6)
    ax.plot(range(len(ours)), ours, label="backfuse.patch", linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local Gemma 3 checkpoint (default: a tiny random-init Gemma 3)")
    ap.add_argument("--width", choices=sorted(WIDTHS), help="a released Gemma 3's width, random weights")
    ap.add_argument("--layers", type=_positive, default=6, help="with --width: decoder layers (default 6)")
    ap.add_argument("--steps", type=_positive, default=20)
    ap.add_argument("--tokens", type=_positive, default=256, help="tokens per packed batch, about (default 256)")
    ap.add_argument("--compare", action="store_true", help="also train the unpatched model and print both losses")
    ap.add_argument("--plot", metavar="PNG", help="with --compare: both loss curves as a PNG")
    ap.add_argument("--no-bf16", action="store_true", help="float32 (the default on a CPU)")
    ap.add_argument("--lr", type=float, help="AdamW's learning rate (default: 2e-2 for the tiny model, 1e-3 otherwise)")
    ap.add_argument("--json", metavar="FILE", help="both runs' losses per step as JSON")
    args = ap.parse_args(argv)
    if args.plot and not args.compare:
        ap.error("--plot draws both curves: add --compare")
    if args.model and args.width:
        ap.error("--model and --width both name the model: pass one")
    bf16 = False if args.no_bf16 else None
    run = dict(model_path=args.model, tokens=args.tokens, bf16=bf16, width=args.width, layers=args.layers, lr=args.lr)
    start = time.perf_counter()
    ours, handed_back = train(args.steps, True, **run)
    seconds = {"patched": time.perf_counter() - start}
    if args.compare:
        start = time.perf_counter()
        theirs = train(args.steps, False, **run)[0]
        seconds["unpatched"] = time.perf_counter() - start
    else:
        theirs = None
    for step, loss in enumerate(ours):
        if theirs is None:
            print(f"{step} {loss:.4f}")
        else:
            print(f"{step} {loss:.4f} {theirs[step]:.4f} {abs(loss - theirs[step]) / abs(theirs[step]):.1e}")
    print(f"handed back to the model's code: {handed_back or 'nothing'}")
    print("seconds a run (model build and first compiles included): "
          + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "patched": ours, "unpatched": theirs, "seconds": seconds,
                       "handed_back": {str(k): v for k, v in handed_back.items()}}, f, indent=1)
    if args.plot:
        _plot(args.plot, ours, theirs)


if __name__ == "__main__":
    main()
