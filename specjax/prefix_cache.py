"""Prefix caching keys: which KV pages of a token sequence can be shared between requests.

Page j of a sequence x holds the K/V of positions j*ps .. (j+1)*ps - 1 (ps = page size). Its content
depends on every token up to its last position, so its key chains the key of page j - 1 with the
page's tokens (a hash of the whole prefix, computed in O(page) per page):

    h_j = blake2b(h_{j-1} || x[j*ps : (j+1)*ps])          (h_{-1} = b"")

The draft's KV lives in the same pages (it shares the target's page table). A draft with shift s
(specjax.drafter: draft entry p holds token x_{p+s}; an EAGLE head's entry p also holds the target
feature f_p) makes page j depend on the s tokens after it as well, so a page's key also covers them:

    key_j = h_j                                          (s = 0: plain decoding, draft models)
    key_j = blake2b(h_j || x[(j+1)*ps : (j+1)*ps + s])    (s = 1: EAGLE heads)

A sequence has keys for the pages j with (j+1)*ps + s <= len(x). A request may reuse at most the
pages that leave it one token to prefill (the token whose logits give its first output token).
"""
from __future__ import annotations

import hashlib

import numpy as np

DIGEST = 16  # bytes of blake2b: collisions (a wrong page reused) are out of reach


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


def page_keys(ids, page_size: int, shift: int = 0) -> list[bytes]:
    """Keys of the pages of ids whose content (with `shift` tokens after the page) is known."""
    x = np.asarray(ids, np.int32)
    n = (len(x) - shift) // page_size
    keys, h = [], b""
    for j in range(max(n, 0)):
        end = (j + 1) * page_size
        h = _h(h, x[j * page_size:end].tobytes())
        keys.append(h if shift == 0 else _h(h, x[end:end + shift].tobytes()))
    return keys


def max_shared_pages(num_ids: int, page_size: int, shift: int = 0) -> int:
    """The most pages a request of num_ids tokens may reuse: at least one token is prefilled and
    the keys need `shift` tokens after the page."""
    return max(0, (num_ids - max(shift, 1)) // page_size)
