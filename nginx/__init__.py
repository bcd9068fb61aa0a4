"""The nginx edge config template, shipped as package data so ``inflight up``
finds it after a plain (non-editable) install; rendered by ``stack.edge``."""
