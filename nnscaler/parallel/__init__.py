"""The driver: parallelize() ties capture, policies, partition and codegen together."""

from nnscaler.parallel.compile import CompileResult, compile_module
from nnscaler.parallel.parallelize import load_generated_class, parallelize
from nnscaler.parallel.savedir import module_outdir

__all__ = ["parallelize", "compile_module", "CompileResult", "module_outdir", "load_generated_class"]
