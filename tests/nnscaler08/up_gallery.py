"""swin's policy gallery (examples/vision/swin/policy/gallery.py of nnScaler 0.8), imported unchanged
from the checkout in $NNSCALER08_UPSTREAM."""

import upstream_shims

upstream_shims.install()
from examples.vision.swin.policy.gallery import pas_1f1b, pas_megatron, pas_mesh_shard  # noqa: E402

__all__ = ["pas_megatron", "pas_mesh_shard", "pas_1f1b"]
