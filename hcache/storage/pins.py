"""A stored prefix held for a load to come: found in the tiers once, and kept from the evictions this
process makes until the load is over, so that what was found is what the load reads.

A chunk in the host pool is held by a reference to its slot (the pool never evicts a referenced chunk); one
below it, by its store's pin (the disk store's quota and TTL pass a pinned chunk over). A chunk held only
in a tier others evict from cannot be held: Redis evicts by the server's policy, and another node's store
over a shared directory by its own quota. It is counted all the same, as found; a load that then misses it
falls short, as it would have without a pin.
"""

from __future__ import annotations

from collections.abc import Sequence

from .host_tier import HostTier


class PinnedPrefix:
    """The chunks of ``keys``, from the first, that some tier of ``tier`` holds (``count``), each held until
    :meth:`release`."""

    def __init__(self, tier: HostTier, keys: Sequence[str]):
        self.tier = tier
        images = [tier.hold(key) for key in keys]
        self._images = [image for image in images if image is not None]
        self._pins: list[tuple[object, list[object]]] = []  # by store: what it holds
        held = [image is not None for image in images]
        missing = [i for i, image in enumerate(images) if image is None]
        for store in tier.stores:
            if not missing:
                break
            pins = store.pin([keys[i] for i in missing])
            self._pins.append((store, [pin for pin in pins if pin is not None]))
            for i, pin in zip(missing, pins):
                held[i] = pin is not None
            missing = [i for i, pin in zip(missing, pins) if pin is None]
        self.count = next((i for i, found in enumerate(held) if not found), len(keys))

    def release(self) -> None:
        """Let every chunk go; a second call does nothing."""
        images, self._images = self._images, []
        pins, self._pins = self._pins, []
        for image in images:
            self.tier.release(image)
        for store, held in pins:
            store.unpin(held)
