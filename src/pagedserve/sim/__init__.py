"""pagedserve's digital twin: the real scheduler and KV-cache manager driven by a
roofline cost model instead of a model runner. Pure Python; never imports torch."""
