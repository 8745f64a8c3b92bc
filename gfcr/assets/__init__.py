"""Files shipped with gfcr: the ``tiny-arith`` and ``tiny-arith-mix`` policies (see their ``README.md``)."""
