"""The changes an offline CPU machine forces on nnScaler 0.8's examples, applied to a fresh copy of
its examples/ (never to our repository). Each change is an exact text replacement that must match
once (so a changed upstream file fails loudly), recorded with the reason; run sizes (steps, layers)
are given on the command line in run.py, through the examples' own options."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


class Adapter:
    """A copy of upstream's examples/ under `work`/ex and the list of changes made to it, by example."""

    def __init__(self, upstream: Path, nanogpt_src: str, work: Path):
        self.up, self.nanogpt_src, self.work = upstream, nanogpt_src, work
        self.ex = work / "ex"
        self.assets = work / "assets"
        self.changes: dict[str, list[str]] = {}

    def fresh_copy(self) -> None:
        if self.ex.exists():
            shutil.rmtree(self.ex)
        self.ex.mkdir(parents=True)
        shutil.copytree(self.up / "examples", self.ex / "examples", ignore=shutil.ignore_patterns(".git"))
        self.assets.mkdir(parents=True, exist_ok=True)

    def patch(self, example: str, rel: str, old: str, new: str, why: str, count: int = 1) -> None:
        path = self.ex / rel
        text = path.read_text()
        found = text.count(old)
        if found != count:
            raise SystemExit(f"adapt {example}: {rel}: expected {count} of {old!r}, found {found}")
        path.write_text(text.replace(old, new))
        self.note(example, f"{rel}: {why}")

    def note(self, example: str, why: str) -> None:
        self.changes.setdefault(example, []).append(why)

    # ---- per example ------------------------------------------------------------------------------

    def nanogpt(self) -> None:
        """karpathy/nanoGPT (a git submodule upstream) cloned in; its shakespeare_char prepare.py run on
        synthetic text (it downloads input.txt only when the file is missing)."""
        from offline_assets import write_text

        dst = self.ex / "examples/nanogpt/nanoGPT"
        if dst.exists():
            shutil.rmtree(dst)
        subprocess.run(["git", "clone", "--quiet", self.nanogpt_src, str(dst)], check=True)
        data = dst / "data/shakespeare_char"
        write_text(data / "input.txt", lines=4000)
        subprocess.run(
            [sys.executable, str(data / "prepare.py")], check=True, cwd=data, stdout=subprocess.DEVNULL
        )
        for name in ("nanogpt_cli", "nanogpt_lightning"):
            self.note(
                name,
                "nanoGPT submodule cloned; data/shakespeare_char/input.txt is synthetic text (no download)",
            )
        self.patch(
            "nanogpt_cli",
            "examples/nanogpt/train_cli_args.yaml",
            "# hook:\n#   on_train_step_end: examples.nanogpt.train_cli.on_train_step_end\n"
            "#   on_val_step_end: examples.nanogpt.train_cli.on_val_step_end",
            "hook:\n  on_train_step_end: examples.nanogpt.train_cli.on_train_step_end\n"
            "  on_val_step_end: examples.nanogpt.train_cli.on_val_step_end",
            "its commented-out hooks turned on (they print the losses)",
        )

    def llama3_demo(self) -> None:
        from offline_assets import tiny_llama, write_text

        model = tiny_llama(self.assets / "tiny_llama")
        text = write_text(self.assets / "llama_text/train.txt", lines=3000)
        rel = "examples/llama3_demo/train.py"
        self.patch(
            "llama3_demo",
            rel,
            "model_id = 'meta-llama/Meta-Llama-3-8B-Instruct'",
            f"model_id = {str(model)!r}",
            "model_id: a tiny local Llama config + word-level tokenizer (hidden 64) in place of the hub id",
        )
        self.patch(
            "llama3_demo",
            rel,
            "datasets.load_dataset(dataset_id, trust_remote_code=True)['train']",
            f"datasets.load_dataset('text', data_files={str(text)!r})['train']",
            "bookcorpus: synthetic local text through datasets' 'text' builder",
        )
        self.patch("llama3_demo", rel, "num_proc=32", "num_proc=1", "num_proc 32 -> 1 (2 CPU cores)", count=2)

    def vit(self) -> None:
        from offline_assets import tiny_vit

        model = tiny_vit(self.assets / "tiny_vit")
        rel = "examples/vit/vit_cli.py"
        self.patch(
            "vit_cli",
            rel,
            'VIT_MODEL_NAME = "google/vit-base-patch16-224"',
            f"VIT_MODEL_NAME = {str(model)!r}",
            "VIT_MODEL_NAME: a tiny local ViT (image 32, hidden 64, 2 layers) in place of the hub id",
        )
        self.patch(
            "vit_cli",
            rel,
            'trainds,  = load_dataset("cifar10", split=["train[:5000]"])',
            'from offline_assets import synthetic_cifar10\n    trainds,  = synthetic_cifar10(split=["train[:5000]"])',
            "cifar10: 200 synthetic 32x32 images with cifar10's features (no download)",
        )
        probe = [sys.executable, "-c", "import torchvision.transforms"]
        if subprocess.run(probe, capture_output=True).returncode != 0:
            self.patch(
                "vit_cli",
                rel,
                "from torchvision.transforms import Normalize, Resize, ToTensor, Compose",
                "from vision_transforms import Normalize, Resize, ToTensor, Compose",
                "torchvision cannot load (no CPU build for this torch on PyPI): its 4 transforms from "
                "vision_transforms.py",
            )
        self.patch(
            "vit_cli",
            "examples/vit/train_cli_args.yaml",
            "# hook:\n#   on_train_step_end: examples.vit.vit_cli.on_train_step_end",
            "hook:\n  on_train_step_end: examples.vit.vit_cli.on_train_step_end",
            "its commented-out hook turned on (it prints the losses)",
        )

    def compile_hf(self) -> None:
        from offline_assets import tiny_llama

        tiny_llama(self.assets / "tiny_llama_hf", layers=2)
        self.note("compile_hf", "-m: a tiny local Llama directory in place of a hub model name")
        self.note(
            "compile_hf", "shims/sitecustomize.py stands in for to_fx_graph, microbatches (trace path, off)"
        )
        self.patch(
            "compile_hf",
            "examples/huggingface_nlp/compile_interface.py",
            "torch.cuda.current_device()",
            "'cpu'",
            "torch.cuda.current_device() -> 'cpu' (7 places)",
            count=7,
        )
        self.patch(
            "compile_hf",
            "examples/huggingface_nlp/compile_interface.py",
            "            loss.backward()\n",
            "            loss.backward()\n            print('# train_loss', float(loss))  # nns08 runner\n",
            "prints each training step's loss (for the table)",
        )

    def swin(self) -> None:
        rel = "examples/vision/swin/model.py"
        self.patch(
            "swin",
            rel,
            "    embed_dim = 192\n    depths = [2, 2, 2, 2]\n    num_heads = [8, 16, 32, 64]\n",
            "    embed_dim = 32\n    depths = [2, 2, 2, 2]\n    num_heads = [4, 8, 16, 32]\n",
            "Config: embed_dim 192 -> 32, heads /2 (CPU)",
        )
        self.patch(
            "swin",
            rel,
            "    img_size = 640\n    window_size = 40\n",
            "    img_size = 64\n    window_size = 4\n",
            "Config: img_size 640 -> 64, window 40 -> 4 (CPU)",
        )
        self.patch("swin", rel, "device=torch.cuda.current_device()", "device='cpu'", "dummy_data on CPU")
        self.note(
            "swin",
            "shims/sitecustomize.py stands in for nnscaler.profiler.timer/memory and (upstream_shims.py) "
            "nnscaler.graph.gener's IntraAutoPlacer",
        )
        rel = "examples/vision/swin/train.py"
        self.patch("swin", rel, "    model.cuda()\n", "", "model.cuda() dropped (CPU)")
        self.patch(
            "swin",
            rel,
            "        model.train_step(samples)\n",
            "        losses = model.train_step(samples)\n"
            "        if torch.distributed.get_rank() == 0:  # nns08 runner\n"
            "            print('# train_loss', idx, float(sum(float(x) for x in losses)))\n",
            "prints each step's loss (for the table)",
        )
