"""A grammar matcher stand-in that fails on demand (tests of grammar-failure isolation)."""
from __future__ import annotations


class BrokenMatcher:
    """A matcher stand-in whose methods in `fail` raise (a matcher xgrammar cannot go on with);
    the others reach the real matcher."""

    def __init__(self, real, fail=("is_terminated", "fill_next_token_bitmask", "traverse_draft_tree",
                                   "accept_token", "rollback", "is_completed")):
        self.real, self.fail = real, set(fail)

    def __getattr__(self, name):
        if name == "_handle" and self.fail:  # xgrammar's batched calls take the handle: they fail too
            raise RuntimeError("injected matcher fault in _handle")
        if name in self.fail:
            def boom(*a, **k):
                raise RuntimeError(f"injected matcher fault in {name}")
            return boom
        return getattr(self.real, name)
