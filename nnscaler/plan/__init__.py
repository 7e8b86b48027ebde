"""`python -m nnscaler.plan`: offline planning (see nnscaler.parallel.plan_cli)."""

__all__: list[str] = []
