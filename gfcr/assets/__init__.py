"""Files shipped with gfcr: the ``tiny-arith`` policy (see ``tiny-arith/README.md``)."""
