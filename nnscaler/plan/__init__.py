"""`python -m nnscaler.plan`: offline planning; the command is `nnscaler.cli.plan`."""

__all__: list[str] = []
