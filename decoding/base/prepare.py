"""A base made ready for the decoder, once: the one function every way of building a decoder
calls (:func:`prepare_base`)."""
from __future__ import annotations

from .attention import use_packed_sdpa
from .check import check_decodable
from .direct import use_direct_body
from .packing import use_packed_linears


def prepare_base(base, packed_attention: bool = True, packed_linears: bool = True, direct_body: bool = True) -> None:
    """Refuse, before any work, a base the loop cannot run; then set up the fast paths the
    decoder's own forwards use (grouped-query SDPA without copying the KV cache, packed weights
    or the few-row kernel, the direct forward of a Llama-form body), and check the decoder's forwards, fast paths included, against the
    model's own. Each part is done once per model object (the checks and the packing keep what
    they did per model), so building a second decoder over the same base costs nothing here."""
    check_decodable(base, probe=False)  # an architecture the loop cannot run is refused before anything
    if packed_attention:
        use_packed_sdpa(base)
    if packed_linears:
        use_packed_linears(base)
    if direct_body:
        use_direct_body(base)
    check_decodable(base)  # the decoder's forwards against the model's own, before anything binds heads or measures
