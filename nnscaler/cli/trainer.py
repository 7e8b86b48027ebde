"""`Trainer`: parallelize a model from `TrainerArgs` and train it (nnScaler's CLI trainer).

    Trainer(["-f", "cfg.yaml", "--max_train_steps", "10"]).run()
    Trainer(train_args=TrainerArgs(...)).run()

Setup: process group (under torchrun) -> seeds and init_env_fn -> a dummy sample (the first
training micro-batch) -> `parallelize` -> data loaders (each data-parallel replica reads its own
share; the ranks of one replica read the same) -> optimizer, LR scheduler, loggers, hook -> resume.
Each optimizer step runs `train_step` over `grad_accumulation_steps` micro-batches; gradients are
the mean over the global batch (`optimizer.grad_reduction: mean`), or the sum.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import nnscaler.cli.resume as _resume
import nnscaler.integration.hf as hf
from nnscaler.cli.aggregate import AggregatedOutputs, default_aggregate, scale_grads
from nnscaler.cli.console import announce_model, say
from nnscaler.cli.elastic import Elastic
from nnscaler.cli.field_names import in_trainer_terms
from nnscaler.cli.forward_args import ForwardConvention, forward_convention
from nnscaler.cli.last_batch import check_short_micro_batch
from nnscaler.cli.loading import load_type
from nnscaler.cli.mixed import infer_micro_batches, model_device, parallelize_sub_modules, run_micro_batches
from nnscaler.cli.peers import Heartbeat
from nnscaler.cli.progress import Progress
from nnscaler.cli.state import SkippingSampler, TrainStatus, rng_states, set_rng_states, to_device
from nnscaler.cli.tracing_weights import load_model_weights
from nnscaler.cli.trainer_args import TrainerArgs
from nnscaler.errors import ConfigError, NnScalerError
from nnscaler.parallel import parallelize
from nnscaler.runtime import ParallelModule
from nnscaler.runtime import init as nnscaler_init
from nnscaler.runtime.dist.groups import create_groups, get_group

__all__ = ["Trainer", "TrainStatus"]

logger = logging.getLogger(__name__)

DEFAULT_INSTANCE_NAME = "trainer"
"""The generated code's instance directory when TrainerArgs.instance_name is not set."""


class Trainer:
    """Trains `TrainerArgs`'s model; `argv` is the command line (`-f cfg.yaml --a.b v ...`)."""

    def __init__(self, argv: list[str] | None = None, *, train_args: TrainerArgs | dict | None = None):
        if train_args is not None and argv:
            raise ConfigError("Trainer: give argv or train_args, not both")
        if train_args is None:
            train_args = TrainerArgs.from_cli(sys.argv[1:] if argv is None else argv)
        elif isinstance(train_args, dict):
            train_args = TrainerArgs.from_dict(train_args)
        self.train_args: TrainerArgs = train_args
        self.model: Any = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.loggers: list[Any] = []
        self.hook: Any = None
        self.train_status = TrainStatus()
        """next_epoch, next_sample, step (= finished_train_steps), best_loss: attributes or dict keys."""
        self.rank, self.world_size = 0, 1
        self.pending_rng: dict[str, Any] | None = None
        self._saved_step = -1
        self.heartbeat: Heartbeat | None = None
        self.sync_group: Any = None
        self._val_step = -1
        self.last_val_loss: float | None = None
        self.losses: list[float] = []
        """The aggregated loss of each optimizer step of this run (every rank)."""
        self.forward_args: ForwardConvention | None = None
        """How a sample becomes the forward's arguments (nnscaler.cli.forward_args); set at setup."""
        self.total_train_steps_per_epoch: int | None = None
        """Optimizer steps in an epoch (a short last global batch counts as one); set at setup."""
        self.max_train_steps: int | None = None
        """Optimizer steps the run ends at: max_train_steps, max_epochs' steps, or the smaller."""
        self.elastic = Elastic()
        """In-memory snapshots and restarts under torchrun's elastic agent (nnscaler.cli.elastic)."""
        self.dataloader_resumed = False
        """The training dataloader's own state was restored from the checkpoint (a dataloader with
        `state_dict` / `load_state_dict`), instead of skipping the samples already seen."""

    # ---- setup ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Set up (compile), then train unless run_mode is 'compile'."""
        try:
            self._setup()
            if self.train_args.compile_mode:
                return
            self._train()
            self.elastic.finish()
        except Exception as err:
            if self.heartbeat is not None:
                peer = None if isinstance(err, NnScalerError) else self.heartbeat.diagnose(err)
                self.heartbeat.publish_failure(peer or err)
                if peer is not None:
                    raise peer from err
            raise
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            self._finalize()

    def _setup(self) -> None:
        args = self.train_args
        if not args.compile_mode:
            nnscaler_init()
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.heartbeat = Heartbeat()
        self.elastic = Elastic.prepare(self)  # after a restart: re-planned args, resume from a snapshot
        args = self.train_args
        cc = args.compute_config
        if not args.compile_mode and self.world_size != cc.runtime_ngpus:
            raise ConfigError(
                f"compute_config.runtime_ngpus is {cc.runtime_ngpus} but {self.world_size} processes run: start "
                f"{cc.runtime_ngpus} (torchrun --nproc_per_node {cc.runtime_ngpus}) or set runtime_ngpus"
            )
        _resume.check_before_start(args.checkpoint, self.rank, args.compile_mode)  # before compiling
        args.init_env(self)
        self.train_dataset = args.create_dataset("train")
        model = args.create_model()
        load_model_weights(args, model)  # tracing_from_weights
        self.hf_config = hf.find_config(model, args.model.hf_prefix)  # for checkpoint.export_hf
        full_numel = sum(p.numel() for p in model.parameters())
        try:
            self.model = self._parallelize(model)
        except ConfigError as err:  # name the Trainer's fields (gen_reuse), not parallelize's (reuse)
            raise in_trainer_terms(err) from err.__cause__
        if args.compile_mode:
            say(self.rank, f"generated code for {cc.runtime_ngpus} ranks under {args.gen_savedir}")
            return
        announce_model(self.rank, args, self.model, full_numel)  # generated code's path, plan summary
        self.device = model_device(self.model)
        self.end2end = isinstance(self.model, ParallelModule)
        """The whole model is one ParallelModule run by train_step (else: parallel sub-modules)."""
        if (
            self.end2end
            and self.model.use_scheduler
            and self.model.nmicros_per_scheduler_step != args.update_freq
        ):
            raise ConfigError(
                f"grad_accumulation_steps ({args.update_freq}) must equal compute_config.pas_config.pipeline_nmicros "
                f"({self.model.nmicros_per_scheduler_step}): a pipelined train_step takes that many micro-batches"
            )
        self.replica, self.num_replicas = self.rank // cc.plan_ngpus, args.scaling_factor
        create_groups(cc.dims.dp_groups())
        self.sync_group = get_group(cc.dims.dp_group(self.rank))
        """The ranks at this rank's place in every replica (nnScaler's sync group)."""
        self._make_loaders()
        self.optimizer = args.create_parallel_optimizer(self.model)
        self.lr_scheduler = args.create_lr_scheduler(self.optimizer)
        self.hook = args.create_hook()
        if self.rank == 0:
            self.loggers = args.create_loggers()
            for lg in self.loggers:
                lg.setup(args.to_dict())
        if args.model.pretrained_path and args.checkpoint.get_resume_checkpoint() is None:
            hf.load_pretrained(self.model, args.model.pretrained_path, args.model.hf_prefix)
            say(self.rank, f"loaded pretrained weights from {args.model.pretrained_path}")
        _resume.resume(self)
        self.elastic.after_resume(self)
        self.hook.after_setup(self)

    def _make_loaders(self) -> None:
        """The train / val data loaders (each replica reads its share) and the step counts."""
        args = self.train_args
        self.loaders = {}
        for stage in ("train", "val"):
            ds = self.train_dataset if stage == "train" else args.create_dataset(stage)
            if ds is None:
                continue
            sampler = args.create_sampler(ds, stage, self.num_replicas, self.replica)
            sampler = SkippingSampler(sampler) if sampler is not None else None
            check_short_micro_batch(
                args, ds, stage, self.num_replicas, self.model, self.forward_args, self.rank
            )
            self.loaders[stage] = (args.create_dataloader(stage, ds, sampler), sampler)
        self.total_train_steps_per_epoch = math.ceil(len(self.loaders["train"][0]) / args.update_freq)
        max_epochs = args.max_epochs or sys.maxsize
        total = args.max_train_steps or self.total_train_steps_per_epoch * max_epochs
        if args.max_epochs and args.max_train_steps:
            total = min(total, self.total_train_steps_per_epoch * args.max_epochs)
        self.max_train_steps = total

    def _parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """The whole model as one ParallelModule (or its listed sub-modules parallelized); the generated
        code goes under `instance_name`, by default `trainer` (a script's own `parallelize` of the same
        class, with no instance name, writes elsewhere)."""
        args = self.train_args
        if args.model.parallel_modules:
            return parallelize_sub_modules(args, model, args.compile_mode)
        sample = self._dummy_sample()
        self.forward_args = forward_convention(model, sample)
        return parallelize(
            model,
            self.forward_args(sample),
            args.resolved_pas_policy,
            args.compute_config,
            gen_savedir=args.gen_savedir,
            reuse=args.gen_reuse,
            instance_name=args.instance_name or DEFAULT_INSTANCE_NAME,
            load_module=not args.compile_mode,
            module_dtype=args.param_dtype,
            broadcast_strategy=args.broadcast_strategy if not args.compile_mode else "none",
            verify=args.verify,
        )

    def _dummy_sample(self) -> Any:
        args = self.train_args
        if fn := args.resolved_dummy_sample_gen_fn:
            sample = fn(args)
        else:
            kwargs = dict(args.create_kwarg(args.dataloader.train_args))
            collate = kwargs.get("collate_fn")
            loader = torch.utils.data.DataLoader(
                self.train_dataset,
                batch_size=args.micro_batch_size,
                collate_fn=load_type(collate) if isinstance(collate, str) else collate,
            )
            sample = next(iter(loader), None)
            if sample is None:
                raise ConfigError(f"dataset.train_args: the training dataset {args.dataset.type} is empty")
        return to_device(sample, torch.device("cpu"), args.input_dtype)

    def _finalize(self) -> None:
        if self.hook is not None:
            self.hook.on_finalize(self)
        for lg in self.loggers:
            lg.finalize()

    # ---- training -------------------------------------------------------------------------------

    def _micro_chunks(self, stage: str):
        """Lists of micro-batches, `update_freq` each (the last one may be shorter)."""
        loader, _ = self.loaders[stage]
        # A resumed run restores the random state where the saved run was: before this epoch's
        # iterator drew its seed (saved at an epoch's end) or after it (saved within the epoch).
        restore, self.pending_rng = (self.pending_rng, None) if stage == "train" else (None, self.pending_rng)
        if restore is not None and self.train_status["next_sample"] == 0:
            set_rng_states(restore)
        it = iter(loader)
        if restore is not None and self.train_status["next_sample"] > 0:
            set_rng_states(restore)
        n = self.train_args.update_freq
        chunk: list[Any] = []
        for batch in it:
            chunk.append(to_device(batch, self.device, self.train_args.input_dtype))
            if len(chunk) == n:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def _padded(self, chunk: list[Any]) -> tuple[list[Any], list[bool] | None]:
        """A pipeline's schedule takes exactly update_freq micro-batches: a short last chunk is padded
        with copies of its last micro-batch, flagged as dummies (no loss, no gradient)."""
        gap = self.train_args.update_freq - len(chunk)
        if not self.end2end or not self.model.use_scheduler or gap <= 0:
            return chunk, None
        return chunk + [chunk[-1]] * gap, [False] * len(chunk) + [True] * gap

    def _model_inputs(self, samples: list[Any]) -> list[Any]:
        """Each micro-batch as the forward's arguments (keyword, or the whole sample in one parameter)."""
        if self.forward_args is None:  # parallel sub-modules: the plain model's forward takes the sample
            self.forward_args = forward_convention(self.model, samples[0])
        return [self.forward_args(s) for s in samples]

    def _batches_per_epoch(self) -> int:
        """Micro-batches one replica runs in an epoch."""
        return len(self.loaders["train"][0])

    def _replica_batches(self) -> int:
        """Micro-batches of this epoch one replica has run."""
        return self.train_status["next_sample"] // (self.train_args.micro_batch_size * self.num_replicas)

    def _aggregate(self, outputs: list[Any]) -> AggregatedOutputs:
        """The step's outputs summed over every replica (optimizer.aggregate_outputs_fn, or losses)."""
        fn = self.train_args.resolved_aggregate_outputs_fn or default_aggregate
        return fn(outputs, self.sync_group)

    def _reduced_loss(self, agg: AggregatedOutputs) -> float:
        how = self.train_args.optimizer.loss_reduction
        if how == "sum":
            return agg.loss_sum
        if how == "per-token-mean":
            if not agg.num_tokens:
                raise ConfigError("optimizer.aggregate_outputs_fn must set num_tokens for per-token-mean")
            return agg.loss_sum / agg.num_tokens
        return agg.loss_sum / max(agg.num_batches, 1)

    def _train(self) -> None:
        args, status = self.train_args, self.train_status
        max_epochs = args.max_epochs or sys.maxsize
        total = self.max_train_steps
        self.progress = Progress(args, total, self.rank == 0, initial=status["step"])
        self.hook.on_train_start(self)
        done = status["step"] >= total
        while not done and status["next_epoch"] < max_epochs:
            epoch = status["next_epoch"]
            loader, sampler = self.loaders["train"]
            if sampler is not None:
                sampler.set_epoch(epoch)
                # a dataloader restored from the checkpoint knows its position: nothing to skip
                sampler.skip = 0 if self.dataloader_resumed else status["next_sample"] // self.num_replicas
            self.hook.on_epoch_start(self, epoch)
            idx = status["next_sample"] // args.global_batch_size
            for chunk in self._micro_chunks("train"):
                self._train_step(epoch, idx, chunk)
                idx += 1
                done = status["step"] >= total
                if args.val_every_n_train_steps and status["step"] % args.val_every_n_train_steps == 0:
                    self._validate()
                ckpt = args.checkpoint
                if ckpt.every_n_train_steps and status["step"] % ckpt.every_n_train_steps == 0:
                    self._save(epoch)
                if done and self._replica_batches() < self._batches_per_epoch():
                    break
            else:
                status["next_epoch"], status["next_sample"] = epoch + 1, 0
                if self.lr_scheduler is not None and args.lr_scheduler.interval == "epoch":
                    self.lr_scheduler.step()
                self.hook.on_epoch_end(self, epoch)
                if args.val_every_n_epochs and (epoch + 1) % args.val_every_n_epochs == 0:
                    self._validate()
                every = args.checkpoint.every_n_epochs
                if every and (epoch + 1) % every == 0:
                    self._save(epoch)
                done = done or status["next_epoch"] >= max_epochs
            if done and self._saved_step != status["step"]:
                self._save(epoch)  # the final state
        self.progress.close()
        if args.checkpoint.export_hf:
            hf.save_pretrained(self.model, args.checkpoint.export_hf, args.model.hf_prefix, self.hf_config)
            say(self.rank, f"exported a Hugging Face checkpoint to {args.checkpoint.export_hf}")
        self.hook.on_train_end(self)

    def _save(self, epoch: int) -> None:
        """Validate at this step (once), then save: as in nnScaler 0.8, `best` follows the validation
        loss of the saved steps (the training loss when there is no validation set)."""
        if not self.train_args.checkpoint.no_save:
            self._validate()
        _resume.save(self, epoch)

    def _train_step(self, epoch: int, idx: int, chunk: list[Any]) -> None:
        args, status, hook, opt = self.train_args, self.train_status, self.hook, self.optimizer
        t0 = time.perf_counter()
        if self.heartbeat is not None:
            self.heartbeat.where = f"training step {status['step'] + 1} (epoch {epoch})"
        hook.on_step_start(self, epoch, idx)
        hook.on_train_step_start(self, chunk)
        n = len(chunk)
        reduction = args.optimizer.grad_reduction
        scale = {"mean": 1.0 / n, "sum": float(args.scaling_factor)}.get(reduction)
        samples, dummy = self._padded(chunk)
        samples = self._model_inputs(samples)
        if self.end2end:
            losses = self.model.train_step(
                samples,
                is_dummy_batch=dummy,
                scale_fn=(lambda loss: loss * scale) if scale is not None else None,
            )[:n]
        else:
            losses = run_micro_batches(self.model, samples, scale)
        hook.on_train_step_end(self, losses)
        agg = self._aggregate(losses)
        count = agg.num_batches
        loss = self._reduced_loss(agg)
        hook.after_aggregate_train_step_outputs(self, agg, loss)
        hook.before_sync_grad(self)
        if hasattr(opt, "sync_shard_grad"):  # before_gnorm_clip sees the optimizer's params' gradients
            opt.sync_shard_grad()
        if reduction == "per-token-mean":  # train_step averaged over replicas; now a mean per token
            if not agg.num_tokens:
                raise ConfigError("optimizer.aggregate_outputs_fn must set num_tokens for per-token-mean")
            scale_grads(self.model, args.scaling_factor / agg.num_tokens)
        hook.after_sync_grad(self)
        hook.before_gnorm_clip(self)
        clip = args.optimizer.clip_gnorm or None
        gnorm = opt.clip_gnorm(clip) if hasattr(opt, "clip_gnorm") else self.model.clip_gnorm(clip)[0]
        hook.after_gnorm_clip(self, gnorm)
        hook.before_optimizer_step(self)
        opt.step()
        hook.after_optimizer_step(self)
        if self.lr_scheduler is not None and args.lr_scheduler.interval == "step":
            self.lr_scheduler.step()
        hook.before_zero_grad(self)
        opt.zero_grad()
        hook.after_zero_grad(self)
        status["step"] += 1
        status["next_sample"] += count * args.micro_batch_size
        self.losses.append(loss)
        elastic_metrics = self.elastic.after_step(self)  # snapshot taken at the step boundary
        wall = time.perf_counter() - t0
        metrics = {
            "train/loss": loss,
            "train/lr": opt.param_groups[0]["lr"],
            "train/gnorm": float(gnorm),
            "train/epoch": epoch,
            "train/step_time": wall,
            "train/samples_per_sec": count * args.micro_batch_size / max(wall, 1e-9),
            **elastic_metrics,
        }
        for m in self.model.modules():  # robust grad_aggregation: steps each replica was dropped in
            if isinstance(m, ParallelModule) and m.aggregation_stats is not None:
                metrics.update(m.aggregation_stats.as_metrics())
        hook.before_log_train_metrics(self, metrics, agg)
        self.log_metrics(metrics, status["step"])
        self.progress.update(status["step"], loss, metrics["train/samples_per_sec"])
        hook.on_step_end(self, epoch, idx, metrics, agg)

    def _validate(self) -> float | None:
        if "val" not in self.loaders:
            return None
        if self._val_step == self.train_status["step"]:  # validated at this step already
            return self.last_val_loss
        self._val_step = self.train_status["step"]
        args = self.train_args
        self.hook.on_val_start(self)
        self.model.eval()
        total = AggregatedOutputs(loss_sum=0.0, num_batches=0)
        saved = rng_states()
        for i, chunk in enumerate(self._micro_chunks("val")):
            if args.max_val_steps and i >= args.max_val_steps:
                break
            self.hook.on_val_step_start(self, chunk)
            samples = self._model_inputs(self._padded(chunk)[0])
            if self.end2end:
                losses = self.model.infer_step(samples)[: len(chunk)]
            else:
                losses = infer_micro_batches(self.model, samples)
            self.hook.on_val_step_end(self, losses)
            agg = self._aggregate(losses)
            # as nnScaler 0.8: each validation step's mean loss, whatever optimizer.loss_reduction says
            self.hook.after_aggregate_val_step_outputs(self, agg, agg.loss_sum / max(agg.num_batches, 1))
            total.loss_sum += agg.loss_sum
            total.num_batches += agg.num_batches
            if agg.num_tokens is not None:
                total.num_tokens = (total.num_tokens or 0) + agg.num_tokens
        set_rng_states(saved)  # validation does not change the training's random stream
        self.model.train()
        val_loss = total.loss_sum / max(total.num_batches, 1)  # the mean over micro-batches
        metrics = {"val/loss": val_loss}
        self.hook.before_log_val_metrics(self, metrics)
        self.log_metrics(metrics, self.train_status["step"])
        self.last_val_loss = val_loss
        say(self.rank, f"validation loss {val_loss:.4f} at step {self.train_status['step']}")
        self.hook.on_val_end(self, val_loss)
        return val_loss

    def log_metrics(
        self, metrics: dict[str, float], step: int | None = None, *, tag: str | None = None
    ) -> None:
        """Send `metrics` to every logger (rank 0 only)."""
        for lg in self.loggers:
            lg.log_metrics(metrics, self.train_status["step"] if step is None else step, tag=tag)

    # ---- checkpoints ----------------------------------------------------------------------------

    @classmethod
    def merge_checkpoint(cls, checkpoint_files: list[str] | str, output_file: str) -> None:
        """Merge a checkpoint (its directory, or its per-rank files) into one file: `.safetensors`
        writes the model weights only, anything else a torch file with model and optimizer state."""
        _resume.merge_checkpoint(checkpoint_files, output_file)
