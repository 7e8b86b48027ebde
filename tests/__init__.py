"""nnscaler's test suite. Helpers: `tests.zoo` (models), `tests.dist_util` (spawn), `tests.parity`."""
