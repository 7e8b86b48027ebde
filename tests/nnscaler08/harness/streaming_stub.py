"""Stands in for mosaicml-streaming (not installed): tests that use it fail when they do."""


class _Missing:
    def __init__(self, *a, **k):
        raise ImportError("mosaicml-streaming is not installed in this environment")


MDSWriter = StreamingDataset = StreamingDataLoader = _Missing
