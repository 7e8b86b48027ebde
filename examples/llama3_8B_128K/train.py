"""Train (or only compile) Llama 3 on long sequences with nnscaler's CLI Trainer.

    # compile the full Llama-3-8B at 128K tokens for 8 H100s, here, without GPUs or torchrun
    python examples/llama3_8B_128K/train.py --run_mode compile --plan_ngpus 8 --runtime_ngpus 8 \\
        --model_id meta-llama/Meta-Llama-3-8B --seq_len 131072 --cluster h100x8 --offline
    # train a mini model on 4 CPU processes: 2-way plan, 2 data-parallel replicas
    torchrun --nproc_per_node 4 examples/llama3_8B_128K/train.py --plan_ngpus 2 --runtime_ngpus 4 \\
        --model_id ./llama3_mini --dataset_path ./bytes_128 --max_train_steps 40 --lr 1e-2

The model is HF `LlamaForCausalLM` built from --model_id's config (model.LlamaLM: weights loaded from
a local checkpoint that has them, else random init; on the meta device with --run_mode compile).
Its forward returns the mean token loss; rows all have the same length, so the trainer's mean over
micro-batches and replicas is the mean over every token of the step. Attention is sdpa with is_causal (no seq x seq mask is materialised), so 128K
sequences trace like short ones. --pipeline_pivots LlamaDecoderLayer makes pipeline stages start at
decoder layers (with --policy autodist, pp or hybrid; --grad_accumulation_steps micro-batches per
step); --recompute_modules LlamaDecoderLayer recomputes each layer's activations in backward.

Rank 0 prints a line every tenth of the run, then `train loss: first F  last L` and where the
generated code went ({gen_savedir}/_parallel_modules/examples/llama3_8B_128K/model/LlamaLM/{name}/).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from examples.llama3_8B_128K.data import load_meta  # noqa: E402
from examples.llama3_8B_128K.model import LLAMA3_8B_ID, describe, load_config  # noqa: E402

PIPELINE_POLICIES = ("autodist", "pp", "hybrid")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan_ngpus", type=int, required=True, help="devices one copy of the plan spans")
    p.add_argument("--runtime_ngpus", type=int, default=-1, help="-1: $WORLD_SIZE (compile: plan_ngpus)")
    p.add_argument(
        "--name",
        default=None,
        help="run name: instance of the generated code, checkpoints (default: {model}_{seq_len})",
    )
    p.add_argument(
        "--model_id", default=LLAMA3_8B_ID, help="a Hugging Face id or a local dir with config.json"
    )
    p.add_argument(
        "--num_layers", type=int, default=None, help="override num_hidden_layers (quick compile checks)"
    )
    p.add_argument(
        "--dataset_path", default=None, help="a dataset saved by bookcorpus.py (compile: optional)"
    )
    p.add_argument("--run_mode", default="run", choices=["run", "compile"])
    p.add_argument(
        "--policy", default="autodist", help="dp, data, tp, pp, hybrid, autodist or a dotted function"
    )
    p.add_argument(
        "--pipeline_pivots", default=None, help="e.g. LlamaDecoderLayer: stages start at these modules"
    )
    p.add_argument("--pipeline_nstages", default="auto", help="pipeline stages ('auto': by the policy)")
    p.add_argument("--pipeline_scheduler", default="1f1b", choices=["1f1b", "gpipe", "1f1b_interleaved"])
    p.add_argument(
        "--cluster", default=None, help="autodist: cluster to plan for (e.g. h100x8; default: this machine)"
    )
    p.add_argument(
        "--mem_constraint", type=float, default=None, help="autodist: GB per device a plan may use"
    )
    p.add_argument(
        "--context_parallel",
        default="off",
        choices=["off", "auto", "zigzag", "ring", "ulysses", "hybrid"],
        help="split the sequence over devices (docs/context_parallel.md): a kind, or auto (autodist chooses "
        "degree and kind); tp / hybrid policies need --cp_size",
    )
    p.add_argument(
        "--cp_size", type=int, default=None, help="context-parallel devices (default: autodist searches it)"
    )
    p.add_argument(
        "--enable_chunk_loss",
        action="store_true",
        help="LM head + loss over sequence chunks with recompute: the logits never exist whole",
    )
    p.add_argument("--recompute_modules", default=None, help="e.g. LlamaDecoderLayer (comma-separated)")
    p.add_argument("--grad_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--micro_batch_size", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=1000)
    p.add_argument("--seq_len", type=int, default=None, help="default: the dataset's, else 131072")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--clip_gnorm", type=float, default=1.0)
    p.add_argument("--precision", default="none", help="none (as built: fp32), bf16, fp16 or fp32")
    p.add_argument("--use_zero", action="store_true", help="shard optimizer state over replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen_savedir", default="./.nnscaler")
    p.add_argument(
        "--gen_reuse",
        default="moo",
        choices=["moo", "match", "override", "graph"],
        help="moo: regenerate when the model, inputs, policy or config differ; match: refuse then",
    )
    p.add_argument("--checkpoint_dir", default=None, help="default: ./checkpoints/{name}")
    p.add_argument("--no_save", action="store_true", help="save no checkpoints")
    p.add_argument(
        "--resume_from", default=None, help="last, best or a checkpoint directory (default: start afresh)"
    )
    p.add_argument(
        "--log_every", type=int, default=None, help="steps between progress lines (default: a tenth)"
    )
    p.add_argument("--offline", action="store_true", help="do not try to fetch from Hugging Face")
    return p.parse_args(argv)


def pas_config(args: argparse.Namespace) -> dict:
    """The policy's options from the flags. Pipelines only with --pipeline_pivots (autodist) or the
    pp / hybrid policies; autodist otherwise searches a single-stage plan."""
    cfg: dict = {}
    if args.recompute_modules:
        cfg["recompute_modules"] = args.recompute_modules
    if args.policy == "autodist":
        if args.cluster:
            cfg["cluster"] = args.cluster
        if args.mem_constraint:
            cfg["mem_constraint"] = args.mem_constraint
    cfg.update(context_parallel_config(args))
    pipelined = bool(args.pipeline_pivots) or args.policy in ("pp", "hybrid")
    if args.pipeline_pivots and args.policy not in PIPELINE_POLICIES and "." not in args.policy:
        raise SystemExit(f"--pipeline_pivots needs --policy autodist, pp or hybrid, not {args.policy!r}")
    if pipelined:
        if args.pipeline_pivots:
            cfg["pipeline_pivots"] = args.pipeline_pivots
        cfg["pipeline_nmicros"] = args.grad_accumulation_steps
        cfg["pipeline_scheduler"] = args.pipeline_scheduler
        if args.pipeline_nstages != "auto":
            cfg["pipeline_nstages"] = int(args.pipeline_nstages)
    elif args.policy == "autodist":
        cfg["pipeline_nstages"] = 1
    return cfg


def context_parallel_config(args: argparse.Namespace) -> dict:
    """cp_size / cp_kind from --context_parallel and --cp_size (autodist searches what is not given)."""
    if args.context_parallel == "off":
        if args.cp_size not in (None, 1):
            raise SystemExit("--cp_size needs --context_parallel (a kind, or auto)")
        return {"cp_size": 1} if args.policy == "autodist" else {}
    cfg: dict = {} if args.context_parallel == "auto" else {"cp_kind": args.context_parallel}
    if args.cp_size:
        cfg["cp_size"] = args.cp_size
    elif args.policy != "autodist":
        raise SystemExit(f"--context_parallel with --policy {args.policy} needs --cp_size")
    if args.policy == "autodist" and args.context_parallel == "auto":
        cfg.update(cp_size=args.cp_size or "auto", cp_kind="auto")
    return cfg


def trainer_args(args: argparse.Namespace, config: dict, seq_len: int, runtime: int) -> dict:
    """The TrainerArgs of the run, as a dict."""
    compile_mode = args.run_mode == "compile"
    if args.dataset_path:
        dataset = {
            "type": "examples.llama3_8B_128K.data.TokenDataset",
            "train_args": {"path": args.dataset_path},
        }
    else:  # compile only: the shapes are all the trace needs
        dataset = {"type": "examples.llama3_8B_128K.data.DummyDataset", "train_args": {"seq_len": seq_len}}
    steps = args.max_train_steps
    return {
        "compute_config": {
            "plan_ngpus": args.plan_ngpus,
            "runtime_ngpus": runtime,
            "use_zero": args.use_zero,
            "pas_config": pas_config(args),
        },
        "pas_policy": args.policy,
        "run_mode": args.run_mode,
        "gen_savedir": args.gen_savedir,
        "gen_reuse": args.gen_reuse,
        "instance_name": args.name,
        "seed": args.seed,
        "precision": args.precision,
        "model": {
            "type": "examples.llama3_8B_128K.model.LlamaLM",
            "args": {
                "model_id": args.model_id,
                "config": config,
                "meta": compile_mode,
                "chunk_loss": args.enable_chunk_loss,
            },
        },
        "optimizer": {
            "type": "torch.optim.AdamW",
            "args": {"lr": args.lr},
            "clip_gnorm": args.clip_gnorm,
        },
        "dataset": dataset,
        "micro_batch_size": args.micro_batch_size,
        "grad_accumulation_steps": args.grad_accumulation_steps,
        "max_train_steps": steps,
        "enable_progress_bar": False,
        "log_progress_every_n_train_steps": args.log_every or max(steps // 10, 1),
        "checkpoint": {
            "save_dir": args.checkpoint_dir or f"./checkpoints/{args.name}",
            "no_save": args.no_save or compile_mode,  # compiling writes no checkpoint: check none
            **({"resume_from": args.resume_from} if args.resume_from else {}),
        },
    }


def main(argv: list[str] | None = None) -> object:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    compile_mode = args.run_mode == "compile"
    world = int(os.environ.get("WORLD_SIZE", 0))
    runtime = (
        args.runtime_ngpus if args.runtime_ngpus > 0 else world or (args.plan_ngpus if compile_mode else 1)
    )
    seq_len = args.seq_len
    if args.dataset_path:
        meta = load_meta(args.dataset_path)
        if seq_len and seq_len != meta.seq_len:
            raise SystemExit(
                f"--seq_len {seq_len} but {args.dataset_path} holds rows of {meta.seq_len} tokens"
            )
        seq_len = meta.seq_len
    elif not compile_mode:
        raise SystemExit(
            "--dataset_path is required to train (create one with examples/llama3_8B_128K/bookcorpus.py)"
        )
    seq_len = seq_len or 131072
    args.name = args.name or f"{Path(args.model_id.rstrip('/')).name}_{seq_len}"
    config = load_config(args.model_id, seq_len, verbose=rank == 0, offline=args.offline)
    if args.num_layers:
        config.num_hidden_layers = args.num_layers
    if args.dataset_path and meta.vocab_size > config.vocab_size:
        raise SystemExit(
            f"{args.dataset_path} has token ids up to {meta.vocab_size - 1} but {args.model_id} has a "
            f"vocabulary of {config.vocab_size}; tokenize with the model's tokenizer or create a larger model"
        )

    if compile_mode and args.policy == "autodist" and not args.cluster and rank == 0:
        print(
            "note: autodist plans for the devices of this machine; pass --cluster (e.g. h100x8) to plan "
            "for the GPUs the generated code will run on",
            flush=True,
        )
    from nnscaler.cli.trainer import Trainer
    from nnscaler.runtime import uninit

    trainer = Trainer(train_args=trainer_args(args, config.to_dict(), seq_len, runtime))
    if rank == 0:
        print(f"model {args.model_id}: {describe(config)}, sequences of {seq_len} tokens", flush=True)
    t0 = time.perf_counter()
    try:
        trainer.run()
    finally:
        uninit()  # destroy the process group before exit (no-op in compile mode)
    seconds = time.perf_counter() - t0
    if rank != 0:
        return trainer
    out = next(Path(args.gen_savedir).resolve().glob(f"_parallel_modules/**/LlamaLM/{args.name}"), None)
    if compile_mode:
        print(
            f"compiled in {seconds:.1f}s: policy {args.policy!r}, plan {args.plan_ngpus}, runtime {runtime}"
        )
    else:
        losses = trainer.losses
        if losses:
            print(
                f"train loss: first {losses[0]:.4f}  last {losses[-1]:.4f}  ({len(losses)} steps in {seconds:.1f}s)"
            )
        else:
            print(
                f"no training step ran: the run is at step {trainer.train_status['step']} of --max_train_steps {args.max_train_steps}"
            )
    print(f"generated code: {out}/gencode{{0..{runtime - 1}}}.py", flush=True)
    return trainer


if __name__ == "__main__":
    main()
