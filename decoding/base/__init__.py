"""The base's compute floor: everything the decoder does to the frozen base model itself —
loading it, running its forwards, and the CPU fast paths under them. Nothing here knows about
heads, trees as policies, or drafting; the rest of :mod:`draftheads.decoding` stands on it.

Import from the module that defines a name (this package exports nothing):

- :mod:`.loading` — ``load_base``: embedded / packaged (``PACKAGED_BASES``) / GGUF / local / Hub
  bases, the dtype a base runs in, the cache folder (``cache_root``) and the source checkout
- :mod:`.architecture` — what of a base's architecture the decoder honours (attention windows,
  logit transforms) and ``check_forwards``' comparison against the model's own forward
- :mod:`.forward` — the decoder's forwards: ``prefill``, ``forward_all``, ``verify``, ``lm_logits``
- :mod:`.check` — ``check_decodable`` (the probe tree through :mod:`.forward`) and ``base_report``
- :mod:`.attention` — grouped-query packed SDPA and ragged steps run packed (``RaggedRows``)
- :mod:`.key_blocks` — a batch's attention without each row's leading padding blocks (``key_runs``)
- :mod:`.mask_memo` — values derived from a forward's mask, made once for all its layers
- :mod:`.cache` — the KV cache with room reserved ahead and per-row compaction (``KVState``)
- :mod:`.packing` — which of the base's weights run packed, the per-machine packing plan cache,
  the context the forwards run in; the heads' packed readout (``use_packed_heads``)
- :mod:`.plan` — where packing pays: per dtype, per shape and row count by measurement
- :mod:`.packed` — a weight's packed copies and the one product through them
- :mod:`.binding` — a module's linear layers bound beside it, wearing the packed class inside forwards
- :mod:`.siblings` — q/k/v and gate/up as one stacked product
- :mod:`.rows` — the rows a forward computes (padding slots left out)
- :mod:`.fewrow` (+ ``fewrow.c``) — the few-row CPU kernel, compiled on first use
- :mod:`.body_call` (+ ``body.c``) — a tree step's whole body in one library call over those kernels
- :mod:`.hardware` — what this machine computes natively, as torch reports it
- :mod:`.fingerprint` — the base's fingerprint a head checkpoint records and ``from_pretrained`` checks
"""
