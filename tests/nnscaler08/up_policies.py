"""nnScaler 0.8's nnscaler/policies.py, loaded unchanged from the checkout in $NNSCALER08_UPSTREAM
(importable by name, so spawned ranks can resolve 'up_policies.pas_tp')."""

import importlib.util
import os

import upstream_shims

upstream_shims.install()
_spec = importlib.util.spec_from_file_location(
    "nnscaler08_policies", os.path.join(upstream_shims.UPSTREAM, "nnscaler", "policies.py")
)
_source = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_source)
pas_dp, pas_tp, pas_data, pas_pp, pas_hybrid = (
    _source.pas_dp,
    _source.pas_tp,
    _source.pas_data,
    _source.pas_pp,
    _source.pas_hybrid,
)
